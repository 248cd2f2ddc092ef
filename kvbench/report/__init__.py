"""Results -> comparison tables in the papers' layout, plots and statistics (``python -m kvbench.report``)."""

from kvbench.report.app import main

__all__ = ["main"]
