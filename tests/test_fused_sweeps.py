"""Fused sweeps (kvbench/sweep.py): which points share a prompt pass and why; every point of a fused group
gives exactly what it gives alone (every method, hyperparameter sweeps, a suffix mode), in a run directory
identical to the solo one but for timings; failed and interrupted groups resume per point."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml

from kvbench import runner, status, store, sweep
from kvbench.tasks.base import Task
from tests.test_runner import make_cfg

METHODS = ["full", "streamingllm", "h2o", "snapkv", "pyramidkv", "tova", "cam", "d2o", "kvmerger", "ems",
           "weightedkv", "chelsea"]
# Columns that hold timings or memory peaks: a fused point measures them in its group.
TIMING_PREDICTIONS = {"prefill_seconds", "compress_seconds", "decode_seconds", "decode_compress_seconds",
                      "tpot_seconds", "peak_memory_bytes", "peak_memory_above_weights_bytes", "fused_group_size"}
TIMING_METRICS = TIMING_PREDICTIONS | {"wall_seconds", "process_peak_memory_bytes", "ttft_seconds"}
# meta.json keys of when and how it ran, and its files' sizes (the results root's path, timings' bytes)
TIMING_META = {"start", "end", "kernels_ran", "files"}
SMALL = ["task.context_lengths=[160]", "task.depths=[0,50,100]", "batch_size=2"]


def point(tmp_path, *overrides):
    return make_cfg(tmp_path, *SMALL, *overrides)


def bare_cfg(tmp_path, *overrides):
    from hydra import compose, initialize_config_dir

    from tests.conftest import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=["model=tiny-llama-random", f"results_root={tmp_path}",
                                                        *overrides])


# -- which points share -------------------------------------------------------------------------------------

def test_points_differing_in_method_budget_and_hyperparameters_share_one_pass(tmp_path):
    cfgs = [point(tmp_path, "method=full"), point(tmp_path, "method=h2o", "budget='0.5'"),
            point(tmp_path, "method=snapkv", "method.window=8"), point(tmp_path, "method=snapkv", "method.window=16")]
    assert sweep.group_points(cfgs) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("other", [
    "model.seed=7",  # another model
    "task.depths=[0]",  # other samples
    "task.mode=query_agnostic",  # another prompt pass
    "limit=1", "seed=3", "batch_size=1", "position_mode=cache_length", "model.attn_implementation=eager",
    "kernels.backend=triton",
])
def test_points_whose_prompt_pass_differs_never_share(tmp_path, other):
    assert sweep.group_points([point(tmp_path, "method=h2o"), point(tmp_path, "method=h2o", other),
                               point(tmp_path, "method=tova")]) == [[0, 2], [1]]


def test_chunked_prefill_and_tasks_with_their_own_passes_run_alone(tmp_path):
    chunked = point(tmp_path, "method=h2o", "engine.prefill_chunk_size=32")
    assert "prefill_chunk_size" in sweep.alone_because(chunked)
    efficiency = bare_cfg(tmp_path, "method=h2o", "task=efficiency")
    assert sweep.alone_because(efficiency) == "task efficiency runs its own engine passes"
    assert sweep.group_points([chunked, point(tmp_path, "method=h2o", "engine.prefill_chunk_size=32"),
                               efficiency, bare_cfg(tmp_path, "method=tova", "task=efficiency")]) == [[0], [1], [2], [3]]


def test_every_task_that_runs_its_own_passes_says_it_cannot_share():
    """A task overriding ``predict`` bypasses the calls a fused group makes: it must declare so."""
    import importlib
    import pkgutil

    import kvbench.tasks

    for info in pkgutil.iter_modules(kvbench.tasks.__path__):
        importlib.import_module(f"kvbench.tasks.{info.name}")
    for task in Task.__subclasses__():
        assert task.shares_prompt_pass == (task.predict is Task.predict), task.name


# -- the same results as alone --------------------------------------------------------------------------------

def fused_and_alone(tmp_path, points: list[list[str]]):
    """Each point run alone under tmp_path/alone and all of them as one group under tmp_path/fused: the run
    directories, alone first."""
    alone = [runner.run(point(tmp_path / "alone", *p)) for p in points]
    cfgs = [point(tmp_path / "fused", *p) for p in points]
    assert sweep.group_points(cfgs) == [list(range(len(points)))]
    outcomes = sweep.run_group([(cfg, None, None) for cfg in cfgs], memory_gb=None)
    assert [state for state, _ in outcomes] == ["done"] * len(points), outcomes
    return alone, [store.run_dir(tmp_path / "fused", rid) for rid in (run_dir.name for run_dir in alone)]


def assert_same_run(alone, fused, group_size: int, other: set[str] = frozenset()):
    """Everything but timings (and ``other`` columns) equal; run ids equal (the run dirs share their name)."""
    assert alone.name == fused.name
    for name, timing in (("predictions", TIMING_PREDICTIONS), ("metrics", TIMING_METRICS)):
        a, f = (pd.read_parquet(d / f"{name}.parquet") for d in (alone, fused))
        assert list(a.columns) == list(f.columns)
        assert (f["fused_group_size"] == group_size).all() and (a["fused_group_size"] == 1).all()
        columns = [c for c in a.columns if c not in timing | other]
        pd.testing.assert_frame_equal(a[columns], f[columns])
    configs = [yaml.safe_load((d / "config.yaml").read_text()) for d in (alone, fused)]
    for config in configs:
        config.pop("results_root")
    assert configs[0] == configs[1]
    metas = [json.loads((d / "meta.json").read_text()) for d in (alone, fused)]
    assert {k: v for k, v in metas[0].items() if k not in TIMING_META} == {
        k: v for k, v in metas[1].items() if k not in TIMING_META}


def test_every_method_fused_gives_what_it_gives_alone(tmp_path):
    points = [[f"method={name}", "budget='0.35'"] for name in METHODS]
    points += [["method=snapkv", "method.window=8"], ["method=kvmerger", "method.epsilon=0.5"],  # hyperparameters
               ["method=h2o", "budget='0.5'"]]
    for alone, fused in zip(*fused_and_alone(tmp_path, points)):
        assert_same_run(alone, fused, group_size=len(points))


def test_a_suffix_mode_fused_gives_what_it_gives_alone(tmp_path):
    """query_agnostic: each point feeds the question on its own compressed row."""
    points = [[f"method={name}", "task.mode=query_agnostic"] for name in ("full", "snapkv", "d2o", "ems")]
    for alone, fused in zip(*fused_and_alone(tmp_path, points)):
        assert_same_run(alone, fused, group_size=len(points))


def test_a_small_memory_budget_splits_the_points_into_passes_with_the_same_results(tmp_path, monkeypatch):
    calls = []
    real = sweep._decode_together
    monkeypatch.setattr(sweep, "_decode_together", lambda engines, *args: calls.append(len(engines)) or
                        real(engines, *args))
    cfgs = [point(tmp_path, f"method={m}") for m in ("full", "h2o", "tova")]
    assert [s for s, _ in sweep.run_group([(cfg, None, None) for cfg in cfgs], memory_gb=1e-9)] == ["done"] * 3
    assert calls and set(calls) == {1}  # every chunk holds one point
    alone = runner.run(point(tmp_path / "alone", "method=h2o"))
    fused = store.run_dir(tmp_path, alone.name)
    assert set(pd.read_parquet(fused / "predictions.parquet")["decode_batch_size"]) == {1}  # what fitted
    assert_same_run(alone, fused, group_size=3, other={"decode_batch_size", "batch_size_realized"})


def test_slots_follow_what_the_longest_prompts_rows_really_hold(tmp_path, monkeypatch):
    """Before any prefill KVMerger (data-driven size) is counted at its whole prompt, like the full cache; after
    the longest prompt's rows are prefilled, a memory budget of their bytes plus two slots' storage gives two
    slots although three were asked for."""
    from kvbench import decode, models
    from kvbench.tasks.base import generation_calls

    cfgs = [point(tmp_path, f"method={m}", "batch_size=3", "task.depths=[0,25,50,75,100]")
            for m in ("h2o", "kvmerger", "full")]
    lm = models.load(cfgs[0].model)
    engines = [runner.build_engine(cfg, lm, *runner.build_method(cfg)) for cfg in cfgs]
    task = runner.build_task(cfgs[0])
    samples = runner.load_samples(cfgs[0], task, lm)
    call = generation_calls([task.build_prompt(sample, lm) for sample in samples], lm)[0]
    h2o, kvmerger, full = (sweep._row_bytes(engine, call) for engine in engines)
    assert h2o < kvmerger == full
    engines = engines[:2]
    rows_seen, slots_seen = [], []  # per batch: (rows, their slots' storage, their prefilled bytes)
    measure = sweep._measured_slots
    monkeypatch.setattr(sweep, "_measured_slots", lambda slots, rows, new, memory: rows_seen.append((
        rows, sum(decode.storage_bytes_per_row(row.engine, row, new) for row in rows),
        sum(row.cache.allocated_bytes() for row in rows))) or measure(slots, rows, new, memory))
    monkeypatch.setattr(sweep, "DecodeBatch", lambda points, slots: slots_seen.append(slots) or decode.DecodeBatch(
        points, slots))
    sweep._decode_together(engines, call, 3, 10**15, lambda: None)
    rows, storage, prefilled = rows_seen[0]
    assert slots_seen == [3] and len(rows) == 2 and all(row.cache is None for row in rows)  # freed once placed
    sweep._decode_together(engines, call, 3, prefilled + 2 * storage + 1, lambda: None)
    assert slots_seen == [3, 2]
    sweep._decode_together(engines, call, 3, 0, lambda: None)
    assert slots_seen == [3, 2, 1]  # never fewer than one slot


# -- resume per point -----------------------------------------------------------------------------------------

def test_a_point_that_fails_in_its_group_fails_alone_and_resumes_alone(tmp_path, monkeypatch):
    from kvbench.methods.tova import TOVA

    def broken(self, *args, **kwargs):
        raise RuntimeError("tova broke")

    monkeypatch.setattr(TOVA, "compress", broken)
    cfgs = [point(tmp_path, f"method={m}") for m in ("full", "tova", "h2o")]
    outcomes = sweep.run_group([(cfg, None, None) for cfg in cfgs])
    assert [s for s, _ in outcomes] == ["done", "failed", "done"] and "tova broke" in outcomes[1][1]
    fused = pd.read_parquet(tmp_path / "metrics.parquet")
    assert set(fused["fused_group_size"]) == {3}, "the others finished in their group"
    states = {r["method"]: r["state"] for r in status.run_states(tmp_path)}
    assert states == {"full": "done", "tova": "failed", "h2o": "done"}  # kvbench status, per point
    finished = {d.name: (d / "meta.json").stat().st_mtime_ns for d in store.finished_runs(tmp_path)}

    monkeypatch.undo()
    outcomes = sweep.run_group([(cfg, None, None) for cfg in cfgs])
    assert [s for s, _ in outcomes] == ["skipped", "done", "skipped"]
    for name, stamp in finished.items():
        assert (store.run_dir(tmp_path, name) / "meta.json").stat().st_mtime_ns == stamp, "finished point redone"


def test_an_interrupted_group_leaves_every_unfinished_point_interrupted_and_runs_them_again(tmp_path, monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "prefill_points", interrupt)
    cfgs = [point(tmp_path, f"method={m}") for m in ("full", "snapkv")]
    with pytest.raises(KeyboardInterrupt):
        sweep.run_group([(cfg, None, None) for cfg in cfgs])
    assert sorted(r["state"] for r in status.run_states(tmp_path)) == ["interrupted", "interrupted"]
    assert not store.finished_runs(tmp_path)
    monkeypatch.undo()
    assert [s for s, _ in sweep.run_group([(cfg, None, None) for cfg in cfgs])] == ["done", "done"]
    assert sorted(r["state"] for r in status.run_states(tmp_path)) == ["done", "done"]


def test_repeated_run_ids_run_once(tmp_path):
    """The full cache ignores the budget: a budget sweep holds it twice."""
    cfgs = [point(tmp_path, "method=full", "budget='0.2'"), point(tmp_path, "method=full", "budget='0.5'"),
            point(tmp_path, "method=tova")]
    outcomes = sweep.run_group([(cfg, None, None) for cfg in cfgs])
    assert [s for s, _ in outcomes] == ["done", "skipped", "done"]
    assert len(store.finished_runs(tmp_path)) == 2


def test_a_group_rebuilds_the_collected_tables_once_with_every_point(tmp_path, monkeypatch):
    collect, calls = store.collect, []
    monkeypatch.setattr(store, "collect", lambda root: calls.append(root) or collect(root))
    cfgs = [point(tmp_path, f"method={name}") for name in ("full", "h2o", "tova")]
    assert [s for s, _ in sweep.run_group([(cfg, None, None) for cfg in cfgs])] == ["done"] * 3
    assert len(calls) == 1, "not once per published point"
    collected = set(pd.read_parquet(tmp_path / "metrics.parquet")["run_id"])
    assert collected == {store.run_id(runner.result_config(cfg)) for cfg in cfgs}



# -- through the launchers ------------------------------------------------------------------------------------

SWEEP = ["model=tiny-llama-random", "task=passkey", "task.context_lengths=[160]", "task.depths=[0,100]",
         "method=full,h2o,snapkv", "budget=0.2,0.5"]


def predictions(root):
    table = pd.read_parquet(root / "predictions.parquet")
    return table.sort_values(["run_id", "sample_id"]).reset_index(drop=True)


def test_a_sweep_fuses_by_default_and_the_switch_runs_every_point_alone(tmp_path, monkeypatch):
    from tests.test_sweeps import sweep as run_sweep

    code, out, _ = run_sweep([*SWEEP, f"results_root={tmp_path / 'fused'}"], monkeypatch)
    assert code == 0 and "kvbench sweep: 6 points: 5 done, 1 skipped, 0 failed" in out
    code, out, _ = run_sweep([*SWEEP, "sweep.fuse=false", f"results_root={tmp_path / 'alone'}"], monkeypatch)
    assert code == 0 and "kvbench sweep: 6 points: 5 done, 1 skipped, 0 failed" in out
    fused, alone = predictions(tmp_path / "fused"), predictions(tmp_path / "alone")
    assert set(fused["fused_group_size"]) == {5} and set(alone["fused_group_size"]) == {1}
    columns = [c for c in fused.columns if c not in TIMING_PREDICTIONS]
    pd.testing.assert_frame_equal(fused[columns], alone[columns])  # same run ids, same rows
    hydra_dirs = sorted(p.parent.parent for p in (tmp_path / "fused" / "_hydra").rglob(".hydra/config.yaml"))
    assert len(hydra_dirs) == 6, "every point has its Hydra job dir"
    assert len([d for d in hydra_dirs if (d / "metrics.parquet").exists()]) == 5, "and its results in it"


def test_ctrl_c_in_a_fused_group_interrupts_its_points_and_the_same_command_resumes(tmp_path, monkeypatch):
    """The sequential launcher: the group that ran is done, the interrupted group's points are recorded as
    interrupted with the command that re-runs each, and the same command runs only them."""
    from tests.test_sweeps import RESUME, sweep as run_sweep

    prefill = sweep.prefill_points
    calls = []

    def interrupt_second_group(*args, **kwargs):  # one prompt per group: the second call is the second group
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return prefill(*args, **kwargs)

    monkeypatch.setattr(sweep, "prefill_points", interrupt_second_group)
    args = [*SWEEP[:3], "task.depths=[0]", "method=full,h2o", "seed=1,2", f"results_root={tmp_path}"]
    code, _, err = run_sweep(args, monkeypatch)
    lines = err.strip().splitlines()
    assert code == 130 and not any("Traceback" in line for line in lines), err
    assert "kvbench sweep: 4 points: 2 done, 0 skipped, 0 failed, 2 interrupted" in lines and lines[-1] == RESUME
    records = {(r["method"], r["state"]) for r in status.run_states(tmp_path)}
    assert records == {("full", "done"), ("h2o", "done"), ("full", "interrupted"), ("h2o", "interrupted")}
    interrupted = [r for r in status.run_states(tmp_path) if r["state"] == "interrupted"]
    assert all(status.what_to_do(tmp_path, r).endswith(f"method={r['method']} seed=2 results_root={tmp_path}")
               for r in interrupted)
    monkeypatch.undo()
    code, out, _ = run_sweep(args, monkeypatch)
    assert code == 0 and "kvbench sweep: 4 points: 2 done, 2 skipped, 0 failed" in out


def test_the_local_launcher_runs_a_group_as_one_process(tmp_path):
    """In a process of its own, as a user runs it (its submitit jobs are processes too)."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # keep what it had
    env = {**os.environ, "KVBENCH_SUBMITIT_DIR": str(tmp_path / "submitit"), "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-m", "kvbench", "-m", *SWEEP, "hydra/launcher=local",
                           f"results_root={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kvbench sweep: 6 points: 5 done, 1 skipped, 0 failed" in proc.stdout
    assert set(predictions(tmp_path)["fused_group_size"]) == {5}
    assert len(list((tmp_path / "submitit").glob("*/*_result.pkl"))) == 1, "one job for the group"
