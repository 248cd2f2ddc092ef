"""What is on disk is what the tables show (issue 24): a run is finished only when its files read back, and
``kvbench status``, a re-run, ``kvbench collect`` and the report agree on every run after every fault (a
kill, Ctrl-C, two writers of one run, a full disk, a damaged file), each naming the command that fixes it.
Ctrl-C of sweeps is in test_sweeps.py."""

from __future__ import annotations

import errno
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest

from kvbench import cli, status, store
from kvbench.errors import disk_full_line
from kvbench.report import data, main as report_main
from kvbench.tasks.base import Task
from tests.conftest import REPO, kvbench_command, pythonpath_with_repo
from tests.full_disk import disk  # noqa: F401 - the fixture
from tests.report.synthetic import passkey_predictions, write

RUN = ["model=tiny-llama-random", "task=passkey", "task.context_lengths=[128]", "task.depths=[0]", "method=h2o"]
# A writer killed (SIGKILL) while it publishes: half of metrics.parquet is in its temp dir.
KILLED_WRITER = """
import sys, time
import pandas as pd
from kvbench import status, store
root, rid = sys.argv[1], sys.argv[2]
status.mark(root, rid, "running", model="m", method="h2o", budget="0.5", task="passkey")
write = pd.DataFrame.to_parquet
def stall(self, path, *args, **kwargs):
    if str(path).endswith("metrics.parquet"):
        open(path, "wb").write(b"PAR1")
        print("writing", flush=True)
        time.sleep(600)
    return write(self, path, *args, **kwargs)
pd.DataFrame.to_parquet = stall
frame = pd.DataFrame({"run_id": [rid], "value": [1.0]})
store.write_run(root, rid, "a: 1", frame, frame, {"run_id": rid})
"""


def passkey_run(root: Path, method: str, value: float = 0.5) -> str:
    """A synthetic published passkey run (the report can tabulate it); returns its run id."""
    predictions = passkey_predictions(method, "fraction", value)
    return write(root, method, "fraction", value, {}, "passkey", predictions, Task().aggregate(predictions))


def refuse(error: OSError):
    """A stand-in for a write that fails with ``error``."""
    def write(*args, **kwargs):
        raise error

    return write


def killed_writer(root: Path, rid: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(root), rid], stdout=subprocess.PIPE,
                             text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": pythonpath_with_repo()})
    assert child.stdout.readline().strip() == "writing"
    child.send_signal(signal.SIGKILL)
    child.wait()


def verdicts(root: Path) -> dict[str, dict]:
    """What each reader says of each run: status's state, whether a re-run skips it, whether the report shows
    it or names it as unreadable, whether collect puts it in the table or names it as left out."""
    states = {r["run_id"]: r for r in status.run_states(root)}
    results = data.load(root)  # the report's reading: rebuilds stale tables first
    skipped = dict(store.collect(root))
    table = set(pd.read_parquet(root / "metrics.parquet")["run_id"])
    return {rid: {"status": record["state"], "rerun skips": store.is_finished(root, rid),
                  "report shows": rid in set(results.metrics["run_id"]),
                  "report names": any(str(store.run_dir(root, rid)) in note for note in results.notes),
                  "collect tables": rid in table, "collect names": rid in skipped}
            for rid, record in states.items()}


def test_status_rerun_collect_and_report_agree_after_every_fault(tmp_path, monkeypatch):
    root = tmp_path / "results"
    done = [passkey_run(root, "full"), passkey_run(root, "h2o")]
    # a full disk after publishing: the run is safe, the collected tables are stale
    monkeypatch.setattr(store, "_write_parquet", refuse(OSError(errno.ENOSPC, "No space left on device")))
    done.append(passkey_run(root, "snapkv"))
    monkeypatch.undo()
    assert store.stale_tables(root) == "1 finished runs are missing from them"
    # two writers finish one run at once: one is published, the other discarded
    twins = [threading.Thread(target=passkey_run, args=(root, "tova")) for _ in range(2)]
    for thread in twins:
        thread.start()
    for thread in twins:
        thread.join()
    done.append(passkey_run(root, "tova"))  # the same run id again: kept, not replaced
    # damaged files
    corrupt = [passkey_run(root, method, 0.2) for method in ("full", "h2o", "snapkv")]
    os.truncate(store.run_dir(root, corrupt[0]) / "metrics.parquet", 100)
    (store.run_dir(root, corrupt[1]) / "meta.json").write_text("{")
    (store.run_dir(root, corrupt[2]) / "predictions.parquet").unlink()
    # a writer killed while publishing, a run stopped by Ctrl-C, one that found the disk full, one running
    killed_writer(root, "killed")
    status.mark(root, "interrupted", "interrupted", error="interrupted (Ctrl-C or SIGINT) before it was published")
    status.mark(root, "no-room", "failed", error=disk_full_line(OSError(errno.ENOSPC, "full"), root))
    status.mark(root, "running", "running")  # this process: alive
    assert [p.name for p in (root / "runs").glob(".killed-*")]  # what the kill left: a temp dir

    records = {r["run_id"]: r for r in status.run_states(root)}
    seen = verdicts(root)
    assert {rid: v["status"] for rid, v in seen.items()} == {
        **dict.fromkeys(done, "done"), **dict.fromkeys(corrupt, "corrupt"), "killed": "stale",
        "interrupted": "interrupted", "no-room": "failed", "running": "running"}
    for rid, verdict in seen.items():
        finished, unreadable = verdict["status"] == "done", verdict["status"] == "corrupt"
        assert verdict == {"status": verdict["status"], "rerun skips": finished, "report shows": finished,
                           "report names": unreadable, "collect tables": finished, "collect names": unreadable}, rid
        if unreadable:  # its saved config.yaml runs it again
            assert status.what_to_do(root, records[rid]).startswith("run it again: python -m kvbench --config-path")
        elif verdict["status"] in ("stale", "interrupted", "failed"):  # started without recorded overrides
            assert status.what_to_do(root, records[rid]) == "run its sweep again (finished points are skipped)"
    # a re-run publishes the unreadable runs again; then every reader sees them done
    for method in ("full", "h2o", "snapkv"):
        passkey_run(root, method, 0.2)
    assert {v["status"] for rid, v in verdicts(root).items() if rid in corrupt} == {"done"}


def test_a_run_whose_parquet_does_not_read_back_is_named_with_its_command_and_run_again(tmp_path, monkeypatch,
                                                                                      capsys, caplog):
    """Issue 24, case 1, on a real run: status, collect and the report name it with the command that
    started it; that command runs it again (the unreadable copy is kept as .prev)."""
    root = tmp_path / "results"
    args = [*RUN, "limit=1", f"results_root={root}"]
    assert kvbench_command(args, monkeypatch)[0] == 0
    [run] = store.published_runs(root)
    os.truncate(run / "metrics.parquet", 100)
    command = "python -m kvbench " + shlex.join(args)
    assert cli.status([str(root)]) == 0
    assert f"{run.name} corrupt: run it again: {command}" in capsys.readouterr().out
    assert cli.collect([str(root)]) == 0
    assert f"skipped {run}: metrics.parquet has 100 bytes" in capsys.readouterr().out
    assert report_main(["--root", str(root), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"no run under '{root}' reads back" in err and command in err
    assert kvbench_command(args, monkeypatch)[0] == 0  # the same command: runs it again
    assert f"run {run.name} does not read back (metrics.parquet has 100 bytes" in caplog.text
    assert store.is_finished(root, run.name) and store.unreadable(root / "runs" / f"{run.name}.prev")
    assert [r["state"] for r in status.run_states(root)] == ["done"]
    assert report_main(["--root", str(root), "--no-plots"]) == 0


def test_the_report_rebuilds_a_truncated_collected_table_or_says_the_command(tmp_path, monkeypatch, capsys):
    """Issue 24, case 2."""
    root = tmp_path / "results"
    rid = passkey_run(root, "full")
    os.truncate(root / "metrics.parquet", 50)
    assert report_main(["--root", str(root), "--no-plots"]) == 0
    assert "the collected tables were stale (cannot be read (ArrowInvalid)): rebuilt" in capsys.readouterr().err
    assert list(pd.read_parquet(root / "metrics.parquet")["run_id"].unique()) == [rid]
    os.truncate(root / "metrics.parquet", 50)
    monkeypatch.setattr(store, "_write_parquet", refuse(PermissionError(errno.EACCES, "Permission denied")))
    assert report_main(["--root", str(root), "--no-plots"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == (f"kvbench report: error: the collected tables in '{root}' cannot be read (ArrowInvalid) "
                         f"nor rebuilt here: run `kvbench collect {root}`")
    assert not any("Traceback" in line for line in lines)


def no_temp_files(root: Path) -> bool:
    return not [p for pattern in ("runs/.*", "status/.*", ".*.tmp") for p in root.glob(pattern)]


# (patterns of the paths whose writes fail, matching writes that still succeed first)
INJECTED = {"publishing": (("runs/.*",), 0),  # the run's own files: it is not published
            "publishing, and its failure record": (("runs/.*", "status/.*"), 1),  # "running" is written
            "after publishing": ((".*.tmp", "_hydra/*"), 0)}  # the collected tables and the Hydra copy


@pytest.mark.full_disk
def test_a_full_disk_is_one_line_and_a_published_run_is_never_failed(disk, monkeypatch):
    """Issue 24, cases 3 and 4: whatever the free space, the command ends in exit 0 (published; the
    collected tables may be stale) or one line and exit 2 (not published), with no traceback and no stray
    temp file; status agrees; once there is room, the same command rebuilds what the disk left stale."""
    args = [*RUN, "limit=1", f"results_root={disk.root}"]
    rooms = [8, 40, 64, 96, 128, 160] if disk.kind == "tmpfs" else list(INJECTED)
    codes = []
    for room in rooms:
        if disk.kind == "tmpfs":
            disk.fill(room * 1024)
        else:
            disk.fail(*INJECTED[room][0], after=INJECTED[room][1])
        code, _, err = kvbench_command(args, monkeypatch)
        lines = err.splitlines()
        assert code in (0, 2) and not any("Traceback" in line for line in lines), err
        states = {r["run_id"]: r["state"] for r in status.run_states(disk.root)}
        if code == 2:
            [line] = [line for line in lines if line.startswith("kvbench: error:")]
            assert line.startswith(f"kvbench: error: No space left on device under {disk.root}"), line
            assert line.endswith("free space and run the same command again (finished runs are kept and skipped)")
            assert "done" not in states.values() and store.published_runs(disk.root) == []
        else:
            assert list(states.values()) == ["done"]
        codes.append(code)
        disk.free()
        assert no_temp_files(disk.root)
        assert kvbench_command(args, monkeypatch)[0] == 0  # room again: published, or skipped
        [record] = status.run_states(disk.root)
        assert record["state"] == "done" and store.stale_tables(disk.root) is None  # rebuilt, on a skip too
        assert set(data.load(disk.root).metrics["run_id"]) == {record["run_id"]}
        shutil.rmtree(disk.root)
    assert codes == [2, 2, 0] if disk.kind == "injected" else 2 in codes


@pytest.mark.full_disk
def test_a_sweep_on_a_full_disk_stops_and_counts_what_status_counts(disk, monkeypatch):
    """Issue 24, case 4 in a sweep: the summary counts done exactly the runs status counts done, the sweep
    stops at the full disk with one line (exit 2), and once there is room the same command finishes it."""
    args = [*RUN[:-1], "method=full,h2o,snapkv,tova", "limit=1", f"results_root={disk.root}"]
    if disk.kind == "tmpfs":
        disk.fill(200 * 1024)  # room for a run or two
    else:
        disk.fail("runs/.*", after=8)  # a run writes 4 files into its temp dir: the third run finds no room
    code, out, err = kvbench_command(["-m", *args], monkeypatch)
    assert code == 2 and not any("Traceback" in line for line in err.splitlines()), err
    [summary] = re.findall(r"kvbench sweep: 4 points: (\d+) done, 0 skipped, 1 failed, (\d+) not run", err)
    assert err.strip().splitlines()[-1] == ("kvbench: error: point #%d found no space left on device: free space "
                                            "and run the same command again to resume (finished points are "
                                            "skipped)" % int(summary[0]))
    states = [r["state"] for r in status.run_states(disk.root)]
    assert states.count("done") == int(summary[0]) and ("failed" in states or "running" in states)
    if disk.kind == "injected":
        assert summary == ("2", "1")
    disk.free()
    code, out, _ = kvbench_command(["-m", *args], monkeypatch)
    assert code == 0 and f"4 points: {4 - int(summary[0])} done, {summary[0]} skipped, 0 failed" in out
    assert len(set(data.load(disk.root).metrics["run_id"])) == 4
