"""kvbench: a research harness for comparing KV-cache compression methods fairly."""

import subprocess
from pathlib import Path

__version__ = "0.1.0"


def code_version() -> dict:
    """The code that makes a result: package version and git commit (None outside a git checkout). Every
    result row records both; ``kvbench status --stale-code`` compares them with the running code."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
        commit = out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"kvbench_version": __version__, "git_commit": commit}
