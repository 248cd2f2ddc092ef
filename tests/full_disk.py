"""Results roots that run out of space, two ways, for tests parametrized over ``DISKS``:

* ``tmpfs``: a real 2 MiB tmpfs mounted for the test (needs root with mount rights; skipped elsewhere), filled
  until ``fill(free)`` bytes are left: every write can fail, Hydra's own included;
* ``injected``: ENOSPC raised by kvbench's writes (text files, parquet files, hard links and copies) into
  paths matching ``fail(pattern, ...)``, after part of the file is written, so that CI without mount rights
  runs the same scenarios.

Tests using them are marked ``full_disk``."""

from __future__ import annotations

import errno
import fnmatch
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pandas as pd
import pytest

DISKS = ["tmpfs", "injected"]
SIZE = "2m"


def _enospc(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


class TmpfsDisk:
    kind = "tmpfs"

    def __init__(self, mount: Path) -> None:
        self.mount = mount
        self.root = mount / "results"
        self._filler = mount / "filler"

    def fill(self, free: int) -> None:
        """Leave ``free`` bytes of room (whole pages; tmpfs counts pages)."""
        self.free()
        stats = os.statvfs(self.mount)
        with open(self._filler, "wb") as handle:
            try:
                handle.write(b"\0" * max(stats.f_bavail * stats.f_frsize - free, 0))
            except OSError:
                pass  # already fuller than asked

    def free(self) -> None:
        self._filler.unlink(missing_ok=True)


class InjectedDisk:
    kind = "injected"

    def __init__(self, root: Path, monkeypatch) -> None:
        self.root = root
        self.patterns: tuple[str, ...] = ()
        self.allowed = 0
        self._patch(monkeypatch)

    def fail(self, *patterns: str, after: int = 0) -> None:
        """Writes into paths (relative to the root) matching any of ``patterns`` raise ENOSPC, once
        ``after`` of them have succeeded."""
        self.patterns, self.allowed = patterns, after

    def free(self) -> None:
        self.patterns = ()

    def _full(self, path) -> bool:
        try:
            relative = Path(os.path.abspath(path)).relative_to(os.path.abspath(self.root))
        except ValueError:
            return False
        if not any(fnmatch.fnmatch(relative.as_posix(), p) for p in self.patterns):
            return False
        self.allowed -= 1
        return self.allowed < 0

    def _patch(self, monkeypatch) -> None:
        disk = self
        write_text, to_parquet, link, copy2 = Path.write_text, pd.DataFrame.to_parquet, os.link, shutil.copy2

        def text(self, data, *args, **kwargs):
            if disk._full(self):
                write_text(self, data[: len(data) // 2], *args, **kwargs)  # a partial write, then no room
                raise _enospc(self)
            return write_text(self, data, *args, **kwargs)

        def parquet(self, path, *args, **kwargs):
            if disk._full(path):
                Path(path).write_bytes(b"PAR1")
                raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")
            return to_parquet(self, path, *args, **kwargs)

        def hard_link(src, dst, *args, **kwargs):
            if disk._full(dst):
                raise _enospc(dst)
            return link(src, dst, *args, **kwargs)

        def copy(src, dst, *args, **kwargs):
            if disk._full(dst):
                raise _enospc(dst)
            return copy2(src, dst, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", text)
        monkeypatch.setattr(pd.DataFrame, "to_parquet", parquet)
        monkeypatch.setattr(os, "link", hard_link)
        monkeypatch.setattr(shutil, "copy2", copy)


@pytest.fixture(params=DISKS)
def disk(request, tmp_path, monkeypatch):
    """A TmpfsDisk or an InjectedDisk whose ``root`` is an empty results root."""
    if request.param == "injected":
        yield InjectedDisk(tmp_path / "results", monkeypatch)
        return
    mount = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mount)],
                              capture_output=True, text=True)
        refused = done.stderr.strip() or done.returncode
    except OSError as err:  # no mount command
        refused = err
    if refused:
        pytest.skip(f"cannot mount a tmpfs here ({refused}); the injected variant runs instead")
    try:
        yield TmpfsDisk(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
