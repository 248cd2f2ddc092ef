"""46 kinds of bad input, one per row: the command-line arguments, a fragment of the one-line error and the
exit status. Every config group and top-level key has a row. Each case runs the real entry point in this
process (fast); ``test_the_console_command_exits_2`` checks one through a subprocess, as a shell sees it.

After every case nothing under the results root looks finished."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvbench import store
from tests.conftest import REPO, kvbench_command

LONGBENCH = ["task=longbench", "task.datasets=[trec]", "task.source=local"]
FIXTURE = REPO / "kvbench" / "data" / "longbench" / "sample" / "trec.jsonl"

# (arguments, fragment of the error line, exit status); {root} is the results root, {data} a data folder,
# {cuda_count} the CUDA devices this machine has.
CASES = [
    # top-level keys
    (["seed=abc"], "seed='abc' must be an integer", 2),
    (["batch_size=0"], "batch_size=0; accepted: an integer >= 1 or auto", 2),
    (["batch_size=many"], "batch_size='many'; accepted: an integer >= 1 or auto", 2),
    (["engine.cuda_graphs=sometimes"], "engine.cuda_graphs='sometimes'; accepted: true, false, auto", 2),
    (["limit=-1"], "limit=-1 must be a positive number of samples, or null", 2),
    (["limit=0"], "limit=0 must be a positive number of samples", 2),
    (["limit=abc"], "limit='abc' must be an integer or null", 2),
    (["position_mode=shifted"], "unknown position_mode 'shifted'; accepted: cache_length, original", 2),
    (["skip_finished=maybe"], "skip_finished='maybe' must be true or false", 2),
    (["results_root={root}/file.txt/results"], "is not a writable folder (Not a directory)", 2),
    (["sed=3"], "unknown key sed; accepted: batch_size, budget, engine, kernels, limit, logger, method, model", 2),
    (["method=full", "-m", "budget=0.2,0.5"], "-m must come first, before every override: kvbench -m model=tiny-llama-random method=full", 2),
    (["-m", "seed=1,abc"], "seed='abc' must be an integer", 2),
    (["seed=[1"], "no viable alternative at input '[1'", 2),
    # model
    (["model=nope"], "unknown model 'nope'; accepted: llama2-13b-chat", 2),
    (["model=llama3.1-8b-instruct", "model.device=cpu", "model.path=/nonexistent"],
     "model.path=/nonexistent is not a folder; set it to a local copy of the model's files, or to null", 2),
    (["model.path=/nonexistent"], "unknown key model.path; accepted: attn_implementation, chat_format", 2),
    # an index past the visible devices: a bad value on a GPU machine as on a CPU one
    (["model.device=cuda:64"], "model.device=cuda:64 but {cuda_count} CUDA devices are visible; accepted: cpu", 2),
    (["model.dtype=float8"], "unknown model.dtype 'float8'; accepted: bfloat16, float16, float32", 2),
    (["model.attn_implementation=magic"], "unknown model.attn_implementation 'magic'; accepted: eager", 2),
    (["model.max_length=abc"], "model.max_length='abc' must be an integer", 2),
    # method
    (["method=nope"], "unknown method 'nope'; accepted: cam, chelsea", 2),
    (["method.sigmaa=3"], "unknown key method.sigmaa for method snapkv; accepted: kernel_size, pooling, window", 2),
    (["+method.sigmaa=3"], "unknown key method.sigmaa for method snapkv; accepted: compress_during_decode", 2),
    (["method=chelsea", "method.chunk_size=abc"], "method.chunk_size='abc' must be an integer or null", 2),
    (["method.pooling=avg"], "snapkv: pooling='avg'; accepted: max, mean", 2),
    (["++method.decode_interval=0"], "snapkv: decode_interval=0 must be >= 1", 2),
    (["method._target_=collections.OrderedDict"], "method._target_='collections.OrderedDict' is not a subclass of "
     "kvbench.methods.base.Method; accepted: a kvbench.methods.base.Method dataclass, as the method choices name "
     "(method=NAME: cam, chelsea", 2),
    (["method._target_=builtins.print"], "method._target_='builtins.print' is a builtin_function_or_method, not a "
     "class; accepted: a kvbench.methods.base.Method dataclass", 2),
    # budget
    (["budget=0.3"], "unknown budget '0.3'; accepted: 0.1, 0.2, 0.35, 0.5, 1.0", 2),
    (["budget.value=1.5"], "budget fraction 1.5 is outside (0, 1]", 2),
    (["budget.value=abc"], "budget.value='abc' must be a number", 2),
    (["budget.kind=percent"], "unknown budget kind 'percent'; accepted: fraction, tokens", 2),
    # task
    (["task=nope"], "unknown task 'nope'; accepted: efficiency", 2),
    (["task=passkey", "task.context_lengths=[10]"], "passkey.context_lengths=[10]: each must be >= 64 tokens", 2),
    (["task=passkey", "task.context_lengths=abc"], "task.context_lengths='abc' must be a list of integers", 2),
    (["task=longbench", "task.source=cloud"], "unknown task.source 'cloud'; accepted: hub, local, sample", 2),
    (LONGBENCH, "task.source=local needs task.data_dir=DIR", 2),
    ([*LONGBENCH, "task.data_dir=/nonexistent"], "found in /nonexistent", 2),
    (["-m", "method=h2o,snapkv", *LONGBENCH, "task.data_dir=/nonexistent/lb"], "found in /nonexistent/lb", 2),
    ([*LONGBENCH, "task.data_dir={data}/corrupt"], "corrupt/trec.jsonl line 3 is not JSON", 2),
    ([*LONGBENCH, "task.data_dir={data}/no_input"], "no_input/trec.jsonl record 0 has no field 'input'; its fields:", 2),
    ([*LONGBENCH, "task.data_dir={data}/empty"], "empty/trec.jsonl holds no records", 2),
    # logger, kernels, launcher, experiment
    (["logger=nope"], "unknown logger 'nope'; accepted: none, wandb", 2),
    (["logger=wandb", "logger.mode=sync"], "unknown logger.mode 'sync'; accepted: disabled, offline, online", 2),
    (["kernels.backend=cuda"], "unknown kernels.backend 'cuda'; accepted: auto, torch, triton", 2),
    (["hydra/launcher=nope"], "unknown hydra/launcher 'nope'; accepted: basic, local, sequential, slurm", 2),
    (["+experiment=nope"], "unknown experiment 'nope'; accepted: chelsea_chunk", 2),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Local LongBench folders with a corrupt, a field-missing and an empty trec.jsonl."""
    folder = tmp_path_factory.mktemp("data")
    lines = FIXTURE.read_text().splitlines()
    for name in ("corrupt", "no_input", "empty"):
        (folder / name).mkdir()
    (folder / "corrupt" / "trec.jsonl").write_text("\n".join(lines[:2] + ['{"_id": "x", "input": "unterminated']))
    record = json.loads(lines[0])
    del record["input"]
    (folder / "no_input" / "trec.jsonl").write_text(json.dumps(record) + "\n")
    (folder / "empty" / "trec.jsonl").write_text("")
    return folder


def call(args: list[str], monkeypatch) -> tuple[int, list[str]]:
    """Run ``kvbench ARGS`` in this process: (exit status, stderr lines)."""
    code, _, err = kvbench_command(args, monkeypatch)
    return code, err.splitlines()


def test_the_table_has_48_cases_and_covers_every_group_and_top_level_key():
    assert len(CASES) == 48
    keys = {a.lstrip("+~").partition("=")[0].split(".")[0] for args, _, _ in CASES for a in args if "=" in a}
    assert {"model", "method", "budget", "task", "logger", "kernels", "hydra/launcher", "experiment"} <= keys
    assert {"seed", "batch_size", "limit", "position_mode", "skip_finished", "results_root", "engine"} <= keys


@pytest.mark.parametrize(("args", "fragment", "status"), CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_input_is_one_line_naming_the_value(args, fragment, status, tmp_path, data, monkeypatch):
    (tmp_path / "file.txt").write_text("")
    root = tmp_path / "results"
    args = [a.format(root=tmp_path, data=data) for a in args]
    fragment = fragment.format(cuda_count=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    flag = args[:1] if args[0] == "-m" else []
    args = [*flag, "model=tiny-llama-random", *args[len(flag):]]
    if not any(a.startswith("results_root=") for a in args):
        args.append(f"results_root={root}")
    code, lines = call(args, monkeypatch)
    errors = [line for line in lines if line.startswith("kvbench: error:")]
    assert code == status, lines
    assert len(errors) == 1 and fragment in errors[0], lines
    assert not any("Traceback" in line for line in lines)
    assert store.finished_runs(root) == []


def test_the_console_command_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvbench", "limit=-1", "model=tiny-llama-random",
                           f"results_root={tmp_path}"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kvbench: error: limit=-1 must be a positive number of samples, or null for all of them"]
    assert store.finished_runs(tmp_path) == []
