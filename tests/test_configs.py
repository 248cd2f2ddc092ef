"""Contract tests over every plug-in config, found by glob: a new method or task file is tested automatically."""

from __future__ import annotations

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from kvbench import runner
from kvbench.methods.base import Method
from kvbench.tasks.base import Task

from tests.conftest import CONF

METHODS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
TASKS = sorted(p.stem for p in (CONF / "task").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
BUDGETS = sorted(p.stem for p in (CONF / "budget").glob("*.yaml"))
# Small, fast settings per task so that every task runs end to end on the tiny model.
FAST_TASK = {
    "passkey": ["task.context_lengths=[128]", "task.depths=[50]"],
    "niah": ["task.context_lengths=[600]", "task.depths=[50]"],
    "efficiency": ["task.context_lengths=[64]", "task.repeats=1", "task.warmup=0", "task.new_tokens=3"],
    **{name: ["task.num_fewshot=1", "+task.gen_kwargs.max_gen_toks=4"] for name in ("lm_eval", "gsm8k", "gsm8k_cot")},
}


def compose_cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=[f"results_root={tmp_path}", *overrides])


@pytest.mark.parametrize("name", METHODS)
def test_method_config_builds_a_method_with_its_hyperparameters(name, tmp_path):
    cfg = compose_cfg(tmp_path, f"method={name}")
    method = instantiate(cfg.method)
    assert isinstance(method, Method)
    assert method.name == name
    declared = {k for k in cfg.method if k != "_target_"}
    assert declared <= set(method.hyperparameters()), "every config key must be a method field"


@pytest.mark.parametrize("name", MODELS)
def test_model_configs_have_the_fields_the_loader_reads(name, tmp_path):
    model = compose_cfg(tmp_path, f"model={name}").model
    for key in ("name", "source", "max_length", "dtype", "device", "attn_implementation"):
        assert model.get(key) is not None, f"{name}: missing {key}"
    if model.source == "hub":
        assert model.hub_id and model.longbench_max_length <= model.max_length


@pytest.mark.parametrize("name", BUDGETS)
def test_budget_configs(name, tmp_path):
    from kvbench.budget import Budget

    budget = compose_cfg(tmp_path, f"budget='{name}'").budget
    assert Budget(budget.kind, budget.value).label == name


@pytest.mark.parametrize("name", TASKS)
def test_task_runs_end_to_end_on_the_tiny_model(name, tmp_path):
    overrides = ["model=tiny-llama-random", "method=full", f"task={name}", "limit=2", *FAST_TASK.get(name, [])]
    cfg = compose_cfg(tmp_path, *overrides)
    task = instantiate(cfg.task)
    assert isinstance(task, Task)
    run_dir = runner.run(cfg)
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    assert len(metrics) > 0 and metrics["value"].notna().all()
    assert (metrics["task"] == task.name).all()  # longbench_e is the longbench task with variant e
    predictions = pd.read_parquet(run_dir / "predictions.parquet")
    assert metrics["mode"].notna().all() and predictions["mode"].notna().all()  # the query mode in every row


@pytest.mark.parametrize("name", [m for m in METHODS if m != "full"])
def test_method_runs_end_to_end_and_compresses(name, tmp_path):
    cfg = compose_cfg(tmp_path, "model=tiny-llama-random", f"method={name}", "budget='0.2'", "task=passkey",
                      *FAST_TASK["passkey"])
    run_dir = runner.run(cfg)
    predictions = pd.read_parquet(run_dir / "predictions.parquet")
    assert (predictions["kv_bytes_compressed"] < predictions["kv_bytes_full"]).all()
