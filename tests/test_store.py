"""The results store beyond one run: rebuilding the collected tables, corrupt runs, stray temp files,
forced re-runs, code versions, permissions and symlinked roots."""

from __future__ import annotations

import json
import logging
import os
import stat
import time

import pandas as pd
import pytest

import kvbench
from kvbench import cli, runner, status, store
from tests.test_runner import make_cfg


def frames(value: float, run: str = "r"):
    return pd.DataFrame({"run_id": [run], "value": [value]}), pd.DataFrame({"run_id": [run], "sample_id": ["s0"]})


def publish(root, rid: str, value: float = 1.0, **kwargs):
    metrics, predictions = frames(value, rid)
    return store.write_run(root, rid, "a: 1", predictions, metrics, {"run_id": rid, "state_note": value}, **kwargs)


@pytest.mark.parametrize("damage", ["truncate metrics.parquet", "garbage meta.json", "remove predictions.parquet",
                                    "truncate config.yaml", "append to metrics.parquet"])
def test_a_run_that_does_not_read_back_is_corrupt_everywhere(tmp_path, damage, caplog, capsys):
    """Status, collect and the skip check (is_finished) agree: the run is corrupt, in no table, and named."""
    publish(tmp_path, "good1")
    bad = publish(tmp_path, "bad")
    verb, name = damage.split(" ")[0], damage.split(" ")[-1]
    path = bad / name
    if verb == "truncate":
        os.truncate(path, 5)
    elif verb == "garbage":
        path.write_bytes(b"\x00garbage")
    elif verb == "remove":
        path.unlink()
    else:
        with open(path, "ab") as handle:
            handle.write(b"tail")
    with caplog.at_level(logging.WARNING, logger="kvbench"):
        publish(tmp_path, "good2")  # a later run still collects
    assert sorted(pd.read_parquet(tmp_path / "metrics.parquet")["run_id"]) == ["good1", "good2"]
    assert "bad" in caplog.text and name in caplog.text
    states = {r["run_id"]: r["state"] for r in status.run_states(tmp_path)}
    assert states == {"good1": "done", "good2": "done", "bad": "corrupt"}
    assert not store.is_finished(tmp_path, "bad") and store.unreadable(bad).startswith(name)
    assert [p.name for p in store.finished_runs(tmp_path)] == ["good1", "good2"]
    assert store.stale_tables(tmp_path) is None  # the tables hold exactly the runs that read back
    assert cli.status([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 corrupt" in out and "bad corrupt: run it again" in out
    assert cli.collect([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"skipped {tmp_path / 'runs' / 'bad'}: {name}" in out and "run it again" in out


def test_a_rerun_replaces_a_run_that_does_not_read_back_and_keeps_it(tmp_path):
    first = publish(tmp_path, "abc", 1.0)
    os.truncate(first / "metrics.parquet", 10)
    publish(tmp_path, "abc", 2.0)  # not asked to replace, but the published run is unreadable
    assert store.is_finished(tmp_path, "abc") and store.read_meta(first)["state_note"] == 2.0
    assert store.unreadable(tmp_path / "runs" / f"abc{store.PREVIOUS}").startswith("metrics.parquet")
    assert list(pd.read_parquet(tmp_path / "metrics.parquet")["value"]) == [2.0]


def test_the_rerun_command_is_the_one_the_run_was_started_with(tmp_path):
    record = {"run_id": "abc", "overrides": ["method=h2o", "budget='0.2'", "results_root=/elsewhere", "+x=a b"]}
    assert status.rerun_command(tmp_path, record) == (
        f"python -m kvbench method=h2o budget=0.2 '+x=a b' results_root={tmp_path}")
    publish(tmp_path, "abc")  # a run without recorded overrides (started from Python): its saved config
    assert status.rerun_command(tmp_path, {"run_id": "abc"}) == (
        f"python -m kvbench --config-path {tmp_path / 'runs' / 'abc'} --config-name config results_root={tmp_path}")
    assert status.what_to_do(tmp_path, {"run_id": "gone"}) == "run its sweep again (finished points are skipped)"


def test_collect_rebuilds_what_a_full_disk_left_out(tmp_path, monkeypatch, caplog, capsys):
    publish(tmp_path, "first")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_write_parquet", disk_full)
    with caplog.at_level(logging.WARNING, logger="kvbench"):
        publish(tmp_path, "second")  # published; the collected table could not be rewritten
    assert "kvbench collect" in caplog.text and "No space left on device" in caplog.text
    assert list(pd.read_parquet(tmp_path / "metrics.parquet")["run_id"]) == ["first"]
    assert store.stale_tables(tmp_path) == "1 finished runs are missing from them"
    assert cli.collect([str(tmp_path)]) == 2  # still full: one line, exit 2
    assert capsys.readouterr().err.startswith("kvbench: error: the collected tables in")
    monkeypatch.undo()
    cli.status([str(tmp_path)])
    assert f"the collected tables in {tmp_path} are stale (1 finished runs" in capsys.readouterr().out
    assert cli.collect([str(tmp_path)]) == 0
    assert sorted(pd.read_parquet(tmp_path / "metrics.parquet")["run_id"]) == ["first", "second"]
    assert store.stale_tables(tmp_path) is None


def test_stray_temp_files_are_cleaned(tmp_path):
    publish(tmp_path, "a")
    stray_table = tmp_path / ".metrics.parquet.999.tmp"  # a writer killed while rebuilding the table
    stray_table.write_text("x")
    old_run, fresh_run = tmp_path / "runs" / ".dead-abc", tmp_path / "runs" / ".live-abc"
    old_run.mkdir()
    fresh_run.mkdir()  # may belong to a run publishing right now: kept
    old_status = tmp_path / "status" / ".x.json.1.tmp"
    old_status.parent.mkdir()
    old_status.write_text("{")
    an_hour_ago = time.time() - store.STALE_TEMP_SECONDS - 60
    for path in (old_run, old_status):
        os.utime(path, (an_hour_ago, an_hour_ago))
    store.collect(tmp_path)
    assert not stray_table.exists() and not old_run.exists() and not old_status.exists()
    assert fresh_run.exists()


def test_a_failed_write_leaves_no_temp_table(tmp_path, monkeypatch):
    def fail(self, path, **kwargs):
        open(path, "w").write("half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", fail)
    with pytest.raises(OSError):
        store._write_parquet(pd.DataFrame({"x": [1]}), tmp_path / "metrics.parquet")
    assert list(tmp_path.iterdir()) == []


def test_replace_keeps_the_previous_run(tmp_path):
    first = publish(tmp_path, "abc", 1.0)
    publish(tmp_path, "abc", 2.0)  # not asked to replace: the published run stays
    assert json.loads((first / "meta.json").read_text())["state_note"] == 1.0
    publish(tmp_path, "abc", 3.0, replace=True)
    assert json.loads((first / "meta.json").read_text())["state_note"] == 3.0
    previous = tmp_path / "runs" / f"abc{store.PREVIOUS}"
    assert json.loads((previous / "meta.json").read_text())["state_note"] == 1.0
    assert [p.name for p in store.finished_runs(tmp_path)] == ["abc"]  # the .prev copy is not a run
    assert list(pd.read_parquet(tmp_path / "metrics.parquet")["value"]) == [3.0]


def test_skip_finished_false_reruns_and_replaces(tmp_path):
    cfg = make_cfg(tmp_path, "method=full")
    first = runner.run(cfg)
    started = json.loads((first / "meta.json").read_text())["start"]
    again = runner.run(make_cfg(tmp_path, "method=full", "skip_finished=false"))
    assert again == first
    assert json.loads((first / "meta.json").read_text())["start"] != started
    assert json.loads((tmp_path / "runs" / f"{first.name}.prev" / "meta.json").read_text())["start"] == started
    assert pd.read_parquet(tmp_path / "metrics.parquet")["run_id"].nunique() == 1


def test_status_lists_runs_of_other_code(tmp_path, capsys):
    publish(tmp_path, "old")
    meta = tmp_path / "runs" / "old" / "meta.json"
    meta.write_text(json.dumps({"run_id": "old", "kvbench_version": "0.0.1", "git_commit": "deadbeef"}))
    current = tmp_path / "runs" / "new"
    publish(tmp_path, "new")
    (current / "meta.json").write_text(json.dumps({"run_id": "new", **kvbench.code_version()}))
    assert cli.status([str(tmp_path), "--stale-code"]) == 0
    out = capsys.readouterr().out
    assert "old" in out and "0.0.1" in out and "deadbeef" in out
    assert "│ new" not in out


def test_published_runs_are_group_readable(tmp_path):
    mask = os.umask(0o022)
    try:
        run = publish(tmp_path, "abc")
    finally:
        os.umask(mask)
    mode = stat.S_IMODE(run.stat().st_mode)
    assert mode & 0o050 == 0o050, oct(mode)  # group may list and read it


def test_artifacts_are_written_under_a_symlinked_root(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    run = publish(link, "abc", artifacts={"zeroscrolls_test/gov_report.json": "{}"})
    assert (real / "runs" / "abc" / "zeroscrolls_test" / "gov_report.json").exists()
    with pytest.raises(ValueError, match="leaves the run directory"):
        publish(link, "evil", artifacts={"../../escape.txt": "x"})
    assert run.name == "abc" and not (real / "escape.txt").exists()
