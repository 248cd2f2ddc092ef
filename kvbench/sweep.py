"""Fused sweeps: the points of one multirun that can share each sample's prompt pass run as one group.

Which points share (``group_points``): those equal in everything but the method and the budget (model, task
and its samples and mode, seed, batch size, limit, position mode, engine settings, kernels, results root), with
a task that generates through ``Task.predict``'s engine calls (``Task.shares_prompt_pass``: not efficiency,
whose timings are the measurement, nor pg19 or lm_eval) and without chunked prefill (each chunk of a point
sees that point's compressed past). Every other point runs alone, as without fusing.

A group (``run_group``, one process or one SLURM job) skips its finished points and repeats of a run id, loads
the model, the task and its samples once, prefills each prompt once for all its points
(``kvbench.shared_prefill``, longest prompt first) and admits every point's row to one ``DecodeBatch`` of all
the points (``batch_size`` slots each, continuous batching: one forward pass per step for every point's rows);
each point's rows are scored and the point is written as if it had run alone (``runner.publish``: its run id,
run dir, status record). A point that fails (its method, its config) fails alone; if the group itself fails,
its unpublished points run again one by one. A full disk stops the group (its unpublished points are not
run), and Ctrl-C records its unpublished points as interrupted, as for points run alone.

Memory: a point holds ``batch_size`` rows at most; the slots shrink to what the memory budget (``sweep.memory_gb``)
holds for every point: each slot's storage, plus one prompt's prefilled rows (a prefilled row is freed once copied
into its slots, ``DecodeBatch.place``). When one slot of every point does not fit, the points are split into
chunks, each with its own prompt passes. Before any prefill a row's size is an estimate (the budget; the whole
prompt for the full cache and for a method whose kept size is data-driven, ``Method.keeps_within_budget``); the
rows of the longest prompt, prefilled first, then size the slots from what they really hold (their storage as
planned, state and tables included).
Timings: a fused row's time to first token is the whole shared pass plus the point's own compression and
suffix, its decode time its share of steps that carried every point's rows; its run's wall time is the group's;
its rows say ``fused_group_size``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
from hydra.utils import get_class
from omegaconf import DictConfig

from kvbench import models, status, store
from kvbench.attention import attach
from kvbench.decode import CPU_AUTO_BATCH, DecodeBatch, DecodeRequest, storage_bytes_per_row
from kvbench.engine import Engine, Generation, Session, _sync
from kvbench.memory import PeakMemory, release_memory
from kvbench.errors import disk_full, failed_outcome
from kvbench.runner import (FULL, Point, announce, build_engine, build_method, build_task, execute, load_samples,
                            mark_ended, open_point, prepare, progress_bar, publish, result_config)
from kvbench.shared_prefill import prefill_points
from kvbench.tasks.base import GenerationCall, generation_calls

log = logging.getLogger("kvbench")
POINT_KEYS = ("method", "budget")  # what the points of one group may differ in
AUTO_MEMORY_SHARE = 0.8  # memory budget when none is set: this share of the device's free memory (the rest:
# activations of the prompt pass, graph pools)
HELD_TWICE = 2  # a point's share of a chunk: one slot in the batch storage and one prefilled row waiting beside it


def alone_because(cfg: DictConfig) -> str | None:
    """Why a point cannot share its prompt passes with other points, or None when it can."""
    task = get_class(cfg.task._target_)
    if not task.shares_prompt_pass:
        return f"task {task.name} runs its own engine passes"
    if cfg.engine.prefill_chunk_size is not None:
        return "engine.prefill_chunk_size is set: each point's chunks see its own compressed past"
    return None


def shared_pass_key(cfg: DictConfig) -> str:
    """A hash of everything a point's prompt passes and samples depend on (all but ``POINT_KEYS``)."""
    config = {k: v for k, v in result_config(cfg).items() if k not in POINT_KEYS}
    return store.run_id({**config, "kernels": cfg.kernels.backend, "results_root": str(cfg.results_root)})


def group_points(cfgs: list[DictConfig]) -> list[list[int]]:
    """The points' indices in groups that share prompt passes, in sweep order; a point that cannot share is a
    group of its own."""
    groups: list[list[int]] = []
    by_key: dict[str, list[int]] = {}
    for index, cfg in enumerate(cfgs):
        if alone_because(cfg) is not None:
            groups.append([index])
            continue
        key = shared_pass_key(cfg)
        if key not in by_key:
            groups.append(by_key.setdefault(key, []))
        by_key[key].append(index)
    return groups


def run_group(points: list[tuple[DictConfig, Path | None, list[str] | None]],
              memory_gb: float | None = None) -> list[tuple[str, str]]:
    """Run one group of points (resolved configs, each with its Hydra job dir and command-line overrides, or
    None); returns each point's outcome for the sweep summary: (done | skipped | failed | not run, detail).
    A full disk stops the group as it stops a sweep: the points not yet published are not run."""
    from kvbench.__main__ import print_metrics

    outcomes, opened = _open(points)
    published: dict[str, Path] = {}
    failures: dict[str, Exception] = {}
    if len(opened) > 1:
        group_failed = False
        try:
            _run_fused([point for _, point in opened], memory_gb, published, failures)
        except Exception:  # noqa: BLE001 - every point not yet published runs alone: only the culprit fails
            log.exception("fused group of %d points failed; its unpublished points run one by one", len(opened))
            failures.clear()
            group_failed = True
        except BaseException as err:
            with status.sigint_held():  # a local sweep's Ctrl-C reaches a run twice (terminal, job controller)
                for _, point in opened:
                    if point.rid not in published:
                        mark_ended(point, err)
            raise
        if group_failed:  # out of the handler: the group's model and caches, held by its traceback, can go
            release_memory()
    disk_is_full = False
    for index, point in opened:
        if disk_is_full and point.rid not in published:
            status.clear(point.root, point.rid)
            outcomes[index] = ("not run", "")
            continue
        try:
            if point.rid in failures:
                raise failures[point.rid]
            run_dir = published.get(point.rid) or execute(point)
        except Exception as err:  # noqa: BLE001 - recorded by execute (or the group); the group goes on
            if point.rid not in failures:
                log.exception("run %s failed", point.rid)
            outcomes[index] = failed_outcome(err, point.root)
            disk_is_full = disk_full(err) is not None
            continue
        print_metrics(run_dir)
        outcomes[index] = ("done", str(run_dir))
    return outcomes


def _open(points: list[tuple[DictConfig, Path | None, list[str] | None]]) -> tuple[list, list[tuple[int, Point]]]:
    """Each point's outcome where it needs no run (finished before, a repeat of an earlier point's run id, a bad
    config), and the others opened (``runner.open_point``: checked, marked running) with their index."""
    outcomes: list[tuple[str, str] | None] = [None] * len(points)
    opened: list[tuple[int, Point]] = []
    seen: set[str] = set()
    for index, (cfg, hydra_dir, overrides) in enumerate(points):
        rid = store.run_id(result_config(cfg))
        if rid in seen:
            outcomes[index] = ("skipped", "the same run as an earlier point of its group")
            continue
        seen.add(rid)
        try:
            point = open_point(cfg, hydra_dir, overrides)
        except Exception as err:  # noqa: BLE001 - a bad point fails alone
            outcomes[index] = failed_outcome(err, cfg.results_root)
            continue
        if point is None:
            outcomes[index] = ("skipped", "finished before")
        else:
            opened.append((index, point))
    return outcomes, opened


def _run_fused(points: list[Point], memory_gb: float | None, published: dict[str, Path],
               failures: dict[str, Exception]) -> None:
    """Execute the points together; publish each (into ``published`` as it lands), or record the error of a
    point that failed (in ``failures``, and its status record) while the others went on."""
    cfg = points[0].cfg
    prepare(cfg)
    lm = models.load(cfg.model)
    task = build_task(cfg)
    engines = {}
    for point in points:
        try:
            engines[point.rid] = build_engine(point.cfg, lm, *build_method(point.cfg))
        except Exception as err:  # noqa: BLE001 - a point that cannot be built fails alone
            _fail(point, err, failures)
    samples = load_samples(cfg, task, lm)
    device = lm.model.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    memory = memory_budget(device, memory_gb)
    live = [point for point in points if point.rid not in failures]
    if not live:
        return
    t0 = time.perf_counter()
    with progress_bar() as progress, attach(lm.model, cfg.model.attn_implementation):
        bar = progress.add_task(f"{len(live)} fused points: {store.run_label(live[0].labels)}",
                                total=len(samples) * len(live))
        prompts = [task.build_prompt(sample, lm) for sample in samples]
        calls = generation_calls(prompts, lm)
        generations = [fused_generate([engines[p.rid] for p in live], call, cfg.batch_size, memory,
                                      lambda: progress.advance(bar)) for call in calls]  # [call][point]
    wall = time.perf_counter() - t0
    group = [point.rid for point in points]
    try:
        for j, point in enumerate(live):  # a point's generations, or its error
            error = next((g[j] for g in generations if isinstance(g[j], Exception)), None)
            if error is not None:
                _fail(point, error, failures)
                continue
            rows = task.result_rows(samples, prompts, calls, [g[j] for g in generations], lm)
            try:
                written = publish(point, task, rows, wall, len(samples), engines[point.rid], group)
            except OSError as err:
                if disk_full(err) is None:
                    raise
                _fail(point, err, failures)
                return  # a full disk: the points after it are not run (``run_group``)
            published[point.rid] = written[0]
            announce(point, *written)
    finally:
        if any(point.rid in published for point in live):  # once for the group (``publish`` leaves them)
            store.update_tables(live[0].root)


def _fail(point: Point, err: Exception, failures: dict[str, Exception]) -> None:
    log.error("run %s failed in its fused group: %s: %s", point.rid, type(err).__name__, err, exc_info=err)
    mark_ended(point, err)
    failures[point.rid] = err


def memory_budget(device: torch.device, memory_gb: float | None) -> int:
    """Bytes a group may hold in prefilled rows: ``memory_gb``, or a share of the device's free memory."""
    if memory_gb is not None:
        return int(memory_gb * 2**30)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    return int(AUTO_MEMORY_SHARE * free)


def fused_generate(engines: list[Engine], call: GenerationCall, batch_size: int | str, memory: int,
                   finished: Callable[[], None]) -> list[list[Generation] | Exception]:
    """``call`` for every engine (one per point): the points in chunks whose rows fit ``memory`` bytes, each
    chunk decoding through one ``DecodeBatch``. Returns per engine its ``Generation``s (the call's order), or the
    error of an engine that failed; ``finished`` is called as each row finishes."""
    generations: list = [None] * len(engines)
    sizes = [HELD_TWICE * _row_bytes(engine, call) for engine in engines]
    with PeakMemory(engines[0].device, baseline=engines[0].weight_bytes) as peak:
        for chunk in _chunks(sizes, memory):
            slots = _slots(batch_size, len(set(map(tuple, call.contexts))), engines[0].device)
            for index, gens in zip(chunk, _decode_together([engines[i] for i in chunk], call, slots, memory,
                                                           finished)):
                generations[index] = gens
    for engine, gens in zip(engines, generations):
        if not isinstance(gens, Exception):
            engine.record_peak(gens, peak.bytes)
    return generations


def _chunks(sizes: list[int], memory: int) -> list[list[int]]:
    """Consecutive indices whose sizes sum to at most ``memory`` (a single index may exceed it)."""
    chunks, total = [[]], 0
    for index, size in enumerate(sizes):
        if chunks[-1] and total + size > memory:
            chunks.append([])
            total = 0
        chunks[-1].append(index)
        total += size
    return chunks


def _slots(batch_size: int | str, rows: int, device: torch.device) -> int:
    """Rows each point decodes at once before memory is measured (``_measured_slots``): ``batch_size`` (``auto``:
    as a run alone picks on a CPU, else every row), never more than the call's rows."""
    wanted = CPU_AUTO_BATCH if batch_size == "auto" and device.type != "cuda" else (
        rows if batch_size == "auto" else batch_size)
    return max(1, min(wanted, rows))


def _row_bytes(engine: Engine, call: GenerationCall) -> int:
    """Estimated bytes of one of the point's rows of ``call`` (its longest prompt), before any prefill: the budget
    (the whole prompt for the full cache and for a method whose size is data-driven), the suffix and the tokens
    it may generate, at the model's K+V bytes per token. ``_measured_slots`` corrects it after the first prompt."""
    config = engine.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * engine.model.dtype.itemsize
    largest = 0
    for b, context in enumerate(call.contexts):
        n = len(context)
        keep = n if engine.method.name == FULL or not engine.method.keeps_within_budget else min(n, int(engine.budget.n_keep(
            torch.tensor([n]), call.max_new_tokens, engine.method.budget_basis)[0]))
        suffix = 0 if call.suffixes is None else len(call.suffixes[b])
        largest = max(largest, keep + suffix + call.max_new_tokens)
    return largest * token_bytes


def _measured_slots(slots: int, rows: list[Session], max_new_tokens: int, memory: int) -> int:
    """``slots``, fewer where the prefilled ``rows`` of the longest prompt (one per point) show that they do not
    fit ``memory``: every slot of every point takes its storage as planned for the row (state and tables
    included), and one prompt's prefilled rows wait beside them until they are placed (then freed)."""
    storage = sum(storage_bytes_per_row(row.engine, row, max_new_tokens) for row in rows)
    prefilled = sum(row.cache.allocated_bytes() for row in rows)
    return max(1, min(slots, (memory - prefilled) // max(1, storage)))


def _decode_together(engines: list[Engine], call: GenerationCall, slots: int, memory: int,
                     finished: Callable[[], None]) -> list[list[Generation] | Exception]:
    """Every distinct prompt of ``call`` prefilled once for all ``engines``, longest first, its rows admitted to
    one ``DecodeBatch`` of the engines (``slots`` rows each, fewer if the longest prompt's rows show they do not
    fit ``memory``: ``_measured_slots``; every step one forward pass for all of them) while every point has a
    free slot, as ``decode_prompts`` admits one point's. An engine that failed gets its error."""
    device = engines[0].device
    request = DecodeRequest(call.max_new_tokens, frozenset(call.stop_token_ids), call.min_new_tokens, call.stop_when)
    groups: dict[tuple, list[int]] = {}
    for b, context in enumerate(call.contexts):
        groups.setdefault((tuple(context), tuple([] if call.suffixes is None else call.suffixes[b])), []).append(b)
    pending = deque(sorted(groups.items(), key=lambda item: -(len(item[0][0]) + len(item[0][1]))))
    results: list = [[None] * len(call.contexts) for _ in engines]
    errors: list[Exception | None] = [None] * len(engines)
    batch: DecodeBatch | None = None
    try:
        while pending or (batch is not None and batch.busy):
            live = [p for p, error in enumerate(errors) if error is None]
            if pending and live and (batch is None or all(batch.vacancies(p) > 0 for p in live)):
                (prompt, suffix), copies = pending.popleft()
                rows = prefill_points([engines[p] for p in live], list(prompt), call.max_new_tokens, list(suffix))
                for p, row in zip(live, rows):
                    if isinstance(row, Exception):
                        errors[p] = row
                if batch is None:
                    prefilled = [row for row in rows if not isinstance(row, Exception)]
                    if not prefilled:
                        break
                    batch = DecodeBatch(engines, _measured_slots(slots, prefilled, call.max_new_tokens, memory))
                for p, row in zip(live, rows):
                    if isinstance(row, Exception):
                        continue
                    row.copies = len(copies)
                    for b in copies:
                        batch.admit(p, row, request, tag=b)
                batch.place()  # the prefilled rows are freed once copied into their slots
                continue  # fill every free slot before the next step
            if batch is None or not batch.busy:
                break
            for done in batch.step():
                results[done.point][done.tag] = done.generation
                finished()
    finally:
        if batch is not None:
            batch.close()
        _sync(device)
    return [error if error is not None else gens for error, gens in zip(errors, results)]
