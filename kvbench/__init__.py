"""kvbench: a research harness for comparing KV-cache compression methods fairly."""

__version__ = "0.1.0"
