"""kvbench: a research harness for comparing KV-cache compression methods fairly."""

import os
import re
import subprocess
from pathlib import Path

__version__ = "0.1.0"

# The CUDA driver's queue of launched work not yet started, at 4x its default size (a user's own setting stands).
# A prompt pass and its compression launch thousands of kernels; at the default size the host blocks on the full
# queue until the pass has nearly ended, and what it does next (placing the row, recording the decode step's CUDA
# graph: kvbench.graphs) then leaves the device idle instead of running under the pass. The driver reads it when
# CUDA initialises, which no kvbench import does.
os.environ.setdefault("CUDA_SCALE_LAUNCH_QUEUES", "4x")

# The folder that holds this package: kvbench's checkout (pip install -e, PYTHONPATH) or site-packages.
SOURCE_ROOT = Path(__file__).resolve().parent.parent


def _is_kvbench_checkout(root: Path) -> bool:
    """Whether ``root`` is a kvbench project folder: its pyproject.toml names the project kvbench (an installed
    copy in site-packages, or the package vendored into another project, has none)."""
    try:
        return re.search(r'^name\s*=\s*"kvbench"\s*$', (root / "pyproject.toml").read_text(), re.M) is not None
    except OSError:
        return False


def _git_commit(root: Path) -> str | None:
    """HEAD of the git repository whose top level is ``root``; None when ``root`` is not a repository's top
    level (a copy of the code inside another repository must not record that repository's commit)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=root)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != root:
        return None
    return lines[1]


def code_version() -> dict:
    """The code that makes a result: package version and git commit (kvbench's own repository's, else None).
    Every result row records both; ``kvbench status --stale-code`` compares them with the running code."""
    commit = _git_commit(SOURCE_ROOT) if _is_kvbench_checkout(SOURCE_ROOT) else None
    return {"kvbench_version": __version__, "git_commit": commit}
