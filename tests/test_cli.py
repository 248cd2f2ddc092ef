"""The ``kvbench`` command: help, subcommands, the default results root, and one label for a run everywhere."""

from __future__ import annotations

import contextlib
import io
import sys

import pandas as pd
import pytest

from kvbench import cli, runner, status, store
from kvbench.errors import ConfigError
from tests.conftest import KEEP_LOGGING
from tests.test_runner import make_cfg


def kvbench(argv: list[str], monkeypatch) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["kvbench", *argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        with pytest.raises(SystemExit) as stop:
            cli.main()
    return stop.value.code, out.getvalue()


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_subcommands_and_config_groups_with_choices(flag, monkeypatch):
    code, out = kvbench([flag], monkeypatch)
    assert code == 0
    for command in ("run", "status", "collect", "report", "bench"):
        assert f"kvbench {command}" in out or f"kvbench [{command}]" in out, command
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "snapkv*" in lines["method"] and "chelsea" in lines["method"]  # * marks the default
    assert "0.2*" in lines["budget"] and "tokens256" in lines["budget"]
    assert "passkey" in lines["task"] and "wandb" in lines["logger"] and "slurm" in lines["hydra/launcher"]
    assert "kvmerger_longbench" in lines["+experiment"]
    assert "inverse of a compression ratio" in out and "seed=42" in out and "limit=null" in out


def test_status_defaults_to_kvbench_results(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVBENCH_RESULTS", str(tmp_path))
    (tmp_path / "runs").mkdir()
    assert cli.status([]) == 0
    assert str(tmp_path) in "".join(capsys.readouterr().out.split())  # the title may wrap
    monkeypatch.setenv("KVBENCH_RESULTS", str(tmp_path / "missing"))
    assert cli.status([]) == 2


def test_run_subcommand_is_the_app(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["kvbench", "run", "model=tiny-llama-random", "task=passkey", "method=full",
                                      "task.context_lengths=[128]", "task.depths=[0]", f"results_root={tmp_path}",
                                      *KEEP_LOGGING])
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main()
    assert len(store.finished_runs(tmp_path)) == 1


def test_a_run_has_one_label_in_status_rows_and_logs(tmp_path, capsys):
    """model / method / budget / task: the failed record kvbench status shows names the run as its rows do."""
    with pytest.raises(ConfigError):
        runner.run(make_cfg(tmp_path, "method=streamingllm", "budget='0.2'", "model.max_length=100"))
    failed = status.run_states(tmp_path)[0]
    done = runner.run(make_cfg(tmp_path, "method=streamingllm", "budget='0.2'"))
    row = pd.read_parquet(done / "metrics.parquet").iloc[0].to_dict()
    assert store.run_label(failed) == store.run_label(row) == "tiny-llama-random / streamingllm / 0.2 / passkey"
    cli.status([str(tmp_path)])
    assert "tiny-llama-random / streamingllm / 0.2 / passkey" in capsys.readouterr().out
