"""Error types the command line turns into one line: bad input (``ConfigError``, exit 2) and a full disk
(``disk_full``, exit 2); an interrupted run exits 130, the shell's status for Ctrl-C."""

from __future__ import annotations

import errno
import os

# A write that found no space (ENOSPC) or no quota (EDQUOT) left: the same remedy, free space.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
INTERRUPTED_EXIT = 130  # 128 + SIGINT


class ConfigError(ValueError):
    """Raised for invalid user input (config values, names, budgets). The CLI prints it as one line."""


def unknown_name(kind: str, value: str, accepted) -> ConfigError:
    return ConfigError(f"unknown {kind} '{value}'; accepted: {', '.join(sorted(accepted))}")


def disk_full(err: BaseException | None) -> OSError | None:
    """The out-of-space error behind ``err`` (itself, or an error it was raised from or while handling),
    else None."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS:
            return err
        err = err.__cause__ or err.__context__
    return None


def describe(err: OSError) -> str:
    """An OSError in a few words: the system's text for its errno (pyarrow's wraps it in more), its file."""
    text = os.strerror(err.errno) if err.errno else str(err)
    return f"{text}: {err.filename}" if err.filename else text


def disk_full_line(err: OSError, root=None) -> str:
    """One line for a full disk (under the results root ``root``): what failed and what to do."""
    where = (f" under {root}" if root else "") + (f" writing {err.filename}" if err.filename else "")
    return (f"{os.strerror(err.errno)}{where}: free space and run the same command again (finished runs are "
            "kept and skipped)")


def failed_outcome(err: Exception, root=None) -> tuple[str, str]:
    """A failed sweep point's outcome for the launchers' summary: its error in one line (a full disk's says
    what to do, under the results root ``root``)."""
    full = disk_full(err)
    return "failed", f"{type(err).__name__}: {err}" if full is None else f"DiskFull: {disk_full_line(full, root)}"


def names_disk_full(text: str) -> bool:
    """Whether an error's text (a job's, from another process) says it found no space or quota left."""
    return any(os.strerror(code).lower() in text.lower() for code in DISK_FULL_ERRNOS)
