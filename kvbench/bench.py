"""Kernel benchmark: time of every kernel-layer operation for both backends over sequence lengths.

    python -m kvbench.bench kernels                                  # CPU defaults (lengths 256..1024)
    python -m kvbench.bench kernels --device cuda --lengths 1024,2048,4096,8192,16384,32768,65536,131072
    python -m kvbench.bench kernels --device cuda --ops cam_step,d2o_step,weightedkv_step,ems_step \
        --lengths 3277,6554 --batch 64 --kv-heads 8 --head-dim 128  # one layer's decode step, graph-replayed
        (the decode steps run only when --ops names them)

Writes ``kernels.parquet`` (one row per operation x backend x length: median seconds of ``--repeats`` calls
after one warm-up call), ``kernels_exponents.parquet`` (the fitted scaling exponent: slope of log time
against log length) and ``kernels.png``/``kernels.pdf`` (time vs length, log-log) under ``--out``.
On CPU the Triton backend runs in Triton's interpreter (TRITON_INTERPRET=1 is set here): its times show
the kernels' scaling, not their speed. A (operation, backend) stops growing once a call exceeds
``--max-seconds``, so quadratic operations do not stall small machines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch

from kvbench.bench_decode_steps import STEP_OPERATIONS
from kvbench.errors import ConfigError

CPU_LENGTHS = "256,512,1024"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _attention_inputs(n: int, queries: int, args, device, dtype):
    """Full causal rows of n keys, the last ``queries`` positions as queries: (q, k, v, valid, kpos, qpos)."""
    g = torch.Generator(device="cpu").manual_seed(n)
    B, Hq, Hkv, D = args.batch, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(B, Hq, queries, D, generator=g).to(device, dtype)
    k = torch.randn(B, Hkv, n, D, generator=g).to(device, dtype)
    v = torch.randn(B, Hkv, n, D, generator=g).to(device, dtype)
    valid = torch.ones(B, Hkv, n, dtype=torch.bool, device=device)
    kpos = torch.arange(n, device=device).expand(B, Hkv, n).contiguous()
    qpos = torch.arange(n - queries, n, device=device).expand(B, queries).contiguous()
    return q, k, v, valid, kpos, qpos


def operations(args, device, dtype) -> dict[str, tuple[str, Callable[[int, str], Callable[[], object]]]]:
    """name -> (expected complexity, make(n, backend) -> a zero-argument call to time)."""
    from kvbench.bench_decode_steps import decode_step_operations
    from kvbench.kernels import column_sums, compact, matching, merge, similarity
    from kvbench.kernels.attention_stats import ragged_attention
    from kvbench.kernels.dispatch import use_backend

    def forced(backend, fn, *a, **kw):
        return lambda: _run_with(use_backend(backend), fn, *a, **kw)

    def decode(n, backend):
        q, k, v, valid, kpos, qpos = _attention_inputs(n, 1, args, device, dtype)
        return forced(backend, ragged_attention, q, k, v, valid, kpos, qpos, 0.125, want_step=True)

    def prefill_lse(n, backend):
        q, k, v, valid, kpos, qpos = _attention_inputs(n, n, args, device, dtype)
        return forced(backend, column_sums.attention_lse, q, k, None, valid, kpos, qpos, 0.125)

    def col_sums(n, backend):
        q, k, v, valid, kpos, qpos = _attention_inputs(n, n, args, device, dtype)
        _, lse = column_sums.attention_lse(q, k, None, valid, kpos, qpos, 0.125)
        return forced(backend, column_sums.column_sums_from_lse, q, k, lse, valid, kpos, qpos, 0.125, 32)

    def merge_op(n, backend):
        _, k, _, _, _, _ = _attention_inputs(n, 1, args, device, dtype)
        target = (torch.arange(n, device=device) // 4).expand(*k.shape[:3]).contiguous()
        weight = torch.rand(k.shape[:3], device=device)
        return forced(backend, merge.scatter_merge, k, target, weight, n // 4 + 1)

    def compact_op(n, backend):
        _, k, _, _, _, _ = _attention_inputs(n, 1, args, device, dtype)
        index = torch.arange(0, n, 2, device=device).expand(*k.shape[:2], -1).contiguous()
        lengths = torch.full(k.shape[:2], n // 2, device=device)
        return forced(backend, compact.compact, k, index, lengths)

    def cosine(n, backend):
        _, k, _, _, _, _ = _attention_inputs(n, 1, args, device, dtype)
        return forced(backend, similarity.adjacent_cosine, k)

    def soft_matching(n, backend):
        _, k, _, _, _, _ = _attention_inputs(n, 1, args, device, dtype)
        start = torch.zeros(k.shape[:2], dtype=torch.long, device=device)
        count = torch.full(k.shape[:2], n, device=device)
        return forced(backend, matching.chunked_soft_matching, k, start, count, 256)

    return {
        "decode_attention": ("n", decode),
        "attention_lse": ("n^2", prefill_lse),
        "column_sums_from_lse": ("n^2", col_sums),
        "scatter_merge": ("n", merge_op),
        "compact": ("n", compact_op),
        "adjacent_cosine": ("n", cosine),
        "chunked_soft_matching": ("n", soft_matching),
        **decode_step_operations(args, device, dtype),
    }


def _run_with(context, fn, *args, **kwargs):
    with context:
        return fn(*args, **kwargs)


def time_call(call: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall seconds of ``repeats`` calls after one warm-up call (compilation, caches)."""
    call()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def scaling_exponents(rows: pd.DataFrame) -> pd.DataFrame:
    """Least-squares slope of log(seconds) on log(length) per (operation, backend), with >= 2 lengths."""
    out = []
    for (op, backend), part in rows.groupby(["operation", "backend"]):
        if part["length"].nunique() >= 2:
            slope = np.polyfit(np.log(part["length"]), np.log(part["seconds"]), 1)[0]
            out.append({"operation": op, "backend": backend, "complexity": part["complexity"].iloc[0],
                        "exponent": float(slope), "max_length": int(part["length"].max())})
    return pd.DataFrame(out, columns=["operation", "backend", "complexity", "exponent", "max_length"])


def plot(rows: pd.DataFrame, exponents: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted(rows["operation"].unique())
    cols = min(4, len(ops))
    fig, axes = plt.subplots((len(ops) + cols - 1) // cols, cols, figsize=(4 * cols, 3.3 * ((len(ops) + cols - 1) // cols)),
                             squeeze=False)
    for ax, op in zip(axes.flat, ops):
        for backend, part in rows[rows["operation"] == op].groupby("backend"):
            fit = exponents[(exponents["operation"] == op) & (exponents["backend"] == backend)]
            label = backend + (f" (slope {fit['exponent'].iloc[0]:.2f})" if len(fit) else "")
            ax.loglog(part["length"], part["seconds"], marker="o", label=label)
        ax.set_title(op, fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    fig.suptitle(f"kvbench kernels on {rows['device'].iloc[0]} ({rows['dtype'].iloc[0]})", fontsize=10)
    fig.tight_layout()
    for suffix in (".png", ".pdf"):
        fig.savefig(path.with_suffix(suffix), dpi=120)
    plt.close(fig)


def run_kernels(args) -> pd.DataFrame:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    ops = operations(args, device, dtype)
    unknown = set(args.ops) - set(ops)
    if unknown:
        raise ConfigError(f"unknown operation(s) {sorted(unknown)}; accepted: {', '.join(ops)}")
    rows = []
    for op in args.ops:
        complexity, make = ops[op]
        for backend in args.backends:
            for n in args.lengths:
                call = make(n, backend)
                seconds = time_call(call, args.repeats, device) / getattr(call, "steps", 1)  # per step
                rows.append({"operation": op, "backend": backend, "length": n, "seconds": seconds,
                             "complexity": complexity, "device": str(device), "dtype": args.dtype,
                             "batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads,
                             "head_dim": args.head_dim, "repeats": args.repeats,
                             "triton_interpreted": device.type == "cpu" and backend == "triton"})
                print(f"{op:24s} {backend:7s} n={n:7d} {seconds * 1e3:10.2f} ms", flush=True)
                if seconds > args.max_seconds:
                    break
    return pd.DataFrame(rows)


def summary(rows: pd.DataFrame, exponents: pd.DataFrame) -> str:
    """Exponent per (operation, backend) and the triton/torch time ratio at each length measured by both."""
    wide = rows.pivot_table(index=["operation", "length"], columns="backend", values="seconds")
    lines = [exponents.to_string(index=False)]
    if {"torch", "triton"} <= set(wide.columns):
        ratio = (wide["triton"] / wide["torch"]).dropna().rename("triton/torch").reset_index()
        lines += ["", ratio.to_string(index=False)]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvbench.bench", description=__doc__.split("\n")[0])
    parser.add_argument("suite", choices=["kernels"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", default=None, help=f"comma-separated (CPU default {CPU_LENGTHS}; CUDA 1k..128k)")
    parser.add_argument("--backends", default="torch,triton")
    parser.add_argument("--ops", default=None, help="comma-separated operations (default: all)")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (CPU float32, CUDA bfloat16)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=3.0, help="stop lengthening past a slower call")
    parser.add_argument("--out", type=Path, default=Path("results/bench_kernels"))
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.lengths = [int(x) for x in (args.lengths or (CPU_LENGTHS if not cuda else
                                                      ",".join(str(1024 << i) for i in range(8)))).split(",")]
    args.backends = args.backends.split(",")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype {args.dtype}; accepted: float32, bfloat16, float16")
    for backend in args.backends:
        if backend not in ("torch", "triton"):
            raise ConfigError(f"--backends entry '{backend}'; accepted: torch, triton")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "cpu" and "triton" in args.backends:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    from kvbench.kernels import dispatch

    # default: every operation but the decode steps, whose shapes are a layer's (--batch, --kv-heads)
    args.ops = args.ops.split(",") if args.ops else [
        op for op in operations(args, torch.device(args.device), torch.float32) if op not in STEP_OPERATIONS]
    rows = run_kernels(args)
    exponents = scaling_exponents(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    rows.to_parquet(args.out / "kernels.parquet", index=False)
    exponents.to_parquet(args.out / "kernels_exponents.parquet", index=False)
    plot(rows, exponents, args.out / "kernels")
    print(summary(rows, exponents))
    print(f"written: {args.out}/kernels.parquet, kernels_exponents.parquet, kernels.png, kernels.pdf "
          f"(backends ran: {dispatch.ran})")


if __name__ == "__main__":
    main()
