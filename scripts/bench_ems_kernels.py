"""EMS's, D2O's and CaM's per-layer decode kernels at the engine's configuration, each kernel's device time.

One layer of ``--rows`` rows x ``--kv-heads`` heads with ``--slots`` stored slots each (the budget plus the
step's new token), a look-up table of ``(gamma - 1)`` x budget entries ``--table-fill`` full (``--hot-share`` of
its members on one centre, as an attention sink that gathers merges would have them), bfloat16 keys
that ``ems_step`` un-RoPEs in registers from a RoPE table (as the engine calls it: ``raw_keys=None``), and
the one-query ``lut_attention`` over the same storage with ``--group`` query heads per KV head (also as a decode
step calls it: ``lut_attention_at_centres``, the members by their centres' positions, the step deferred), and D2O's
``d2o_step`` (victim, best match over every key, merge); D2O's observation and step as the engine's in-place
path runs them (the step attention's launch then ``d2o_step``, against ``d2o_step`` making the step attention in
its first launch); and CaM's ``cam_step`` (H2O's victim, the next ``merge_tokens`` positions, the draw and the
merge) over the same keys and positions. Each is captured as a CUDA graph of ``STEPS`` calls and replayed; the
profiler's kernel times are per call.

    python -m scripts.bench_ems_kernels --rows 1 --slots 6555
    python -m scripts.bench_ems_kernels --rows 32 --slots 3277

Tile settings are module constants of the kernels' modules; ``--set MODULE.NAME=VALUE`` (repeatable, a
comma-separated list of values runs each) overrides one for a run, to compare tilings inside one process.
"""

from __future__ import annotations

import argparse
import itertools
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kvbench.kernels import (triton_cam_step, triton_d2o_step, triton_decode, triton_ems_step, triton_lut_attention,
                             triton_slots)
from kvbench.kernels.cam_step import cam_step
from kvbench.kernels.d2o_step import d2o_step
from kvbench.kernels.ems_step import ems_step
from kvbench.kernels.lut_attention import lut_attention, lut_attention_at_centres

STEPS = 8
MODULES = {"ems": triton_ems_step, "d2o": triton_d2o_step, "lut": triton_lut_attention, "decode": triton_decode,
           "slots": triton_slots, "cam": triton_cam_step}


class TableRope:
    """The engine's ``attention.Rope`` as ``ems_step`` reads it: Llama 3.1's frequencies and their table."""

    def __init__(self, head_dim: int, device: torch.device, positions: int = 131072) -> None:
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
        self.frequencies = (inv_freq, 1.0)
        angle = torch.arange(positions, device=device).float()[:, None] * inv_freq[None, :]
        self._table = (angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16))

    def table(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        assert dtype == torch.bfloat16, dtype
        return self._table


def layer(args, device: torch.device) -> dict:
    """Storage after a long prompt: positions an increasing sample of ``--context``, the newest last."""
    g = torch.Generator(device="cpu").manual_seed(0)
    B, H, C, D = args.rows, args.kv_heads, args.slots, args.head_dim
    keep = C - 1
    positions = torch.sort(torch.randperm(args.context - 1, generator=g)[:C - 1]).values
    positions = torch.cat([positions, torch.tensor([args.context - 1])]).expand(B, H, C).contiguous()
    E = int((args.gamma - 1) * keep)
    used = torch.rand(B, H, E, generator=g) < args.table_fill
    centres = positions.gather(2, torch.randint(0, C - 1, (B, H, E), generator=g))
    return dict(keys=torch.randn(B, H, C, D, generator=g).to(device, torch.bfloat16),
                values=torch.randn(B, H, C, D, generator=g).to(device, torch.bfloat16),
                positions=positions.to(device), lengths=torch.full((B, H), C, device=device),
                state=torch.rand(5, B, H, C, generator=g).to(device),
                n_keep=torch.full((B,), keep, device=device),
                lut=(torch.where(used, args.context + torch.arange(E), -1).to(device),
                     torch.where(used, centres, -1).to(device),
                     torch.where(used, 1.0, -1.0).float().to(device)),
                member_slot=torch.where(torch.rand(B, H, E, generator=g) < args.hot_share, 0,
                                        torch.randint(0, C - 1, (B, H, E), generator=g)).to(device),
                live=used.to(device),
                query=torch.randn(B, H * args.group, 1, D, generator=g).to(device, torch.bfloat16))


def timed(call, label: str) -> list[str]:
    """Per-call device time of each kernel of ``call``, replayed from a CUDA graph of ``STEPS`` calls."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(STEPS):
            call()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    replays = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time / (replays * STEPS)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) * 1000 / (replays * STEPS)
    lines = [f"  {label}: {wall:8.1f} us a call (graph wall), kernels {sum(kernels.values()):8.1f} us"]
    lines += [f"      {us:8.1f} us  {name[:70]}" for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])]
    return lines


def _constant(text: str) -> int | tuple[int, ...]:
    """An integer, or a tuple of integers written with colons (``64:4:3``)."""
    return tuple(int(v) for v in text.split(":")) if ":" in text else int(text)


def parse_overrides(items: list[str], parser: argparse.ArgumentParser) -> list[tuple[tuple[str, str], list]]:
    """``--set MODULE.NAME=V1,V2`` items as ((module, name), values), each checked: a module of ``MODULES``, a
    constant it defines, values that parse; otherwise the parser's error names the bad part and what is accepted."""
    overrides = []
    for item in items:
        target, _, values = item.partition("=")
        module, _, name = target.partition(".")
        if module not in MODULES:
            parser.error(f"--set {item}: no module {module!r}; accepted: {', '.join(MODULES)}")
        constants = sorted(n for n in vars(MODULES[module]) if n.isupper() and not n.startswith("_"))
        if name not in constants:
            parser.error(f"--set {item}: {module} has no constant {name!r}; accepted: {', '.join(constants)}")
        try:
            overrides.append(((module, name), [_constant(v) for v in values.split(",")]))
        except ValueError:
            parser.error(f"--set {item}: values must be integers or colon-joined tuples of them (64:4:3), "
                         f"comma-separated; got {values!r}")
    return overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1, help="batch rows (each --kv-heads heads)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--slots", type=int, default=6555, help="stored slots a head (budget + 1)")
    parser.add_argument("--context", type=int, default=32768, help="positions the slots are sampled from")
    parser.add_argument("--gamma", type=float, default=4.0)
    parser.add_argument("--table-fill", type=float, default=0.9)
    parser.add_argument("--hot-share", type=float, default=0.0,
                        help="share of the table's members whose centre is the row's first slot (lut_attention)")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=V1,V2",
                        help=f"override a tile constant (a tuple: 64:4:3); modules: {', '.join(MODULES)}")
    parser.add_argument("--only", choices=("ems_step", "lut_attention", "d2o_step", "d2o_observe_step", "cam_step"),
                        default=None)
    args = parser.parse_args()
    overrides = parse_overrides(args.set, parser)
    if not 0 <= args.hot_share <= 1:
        parser.error(f"--hot-share {args.hot_share}: a share of the table's members, in [0, 1]")
    device = torch.device("cuda")
    rope = TableRope(args.head_dim, device)
    for choice in itertools.product(*(values for _, values in overrides)):
        for ((module, name), _), value in zip(overrides, choice):
            setattr(MODULES[module], name, value)
        triton_decode._programs_wanted.cache_clear()  # the split plans follow an overridden decode.WAVES
        label = ", ".join(f"{m}.{n}={v}" for ((m, n), _), v in zip(overrides, choice)) or "as committed"
        print(f"== {args.rows} rows x {args.kv_heads} heads x {args.slots} slots; {label}", flush=True)
        s = layer(args, device)
        scaling = args.head_dim ** -0.5
        if args.only in (None, "ems_step"):
            # tau 0: every step merges (the table's and the merge's work every time)
            def step():
                ems_step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], None, tuple(s["state"][:3]),
                         (s["state"][3], s["state"][4], None), s["lut"], s["n_keep"], 32, 0.0, args.gamma,
                         "key_value", False, rope)
                s["lengths"].fill_(args.slots)  # the next step's appended token
            print("\n".join(timed(step, "ems_step")), flush=True)
        if args.only in (None, "lut_attention"):
            def attend():
                lut_attention(s["query"], s["keys"], s["values"], s["lengths"], s["member_slot"], s["lut"][2],
                              s["live"], scaling, want_step=True)
            print("\n".join(timed(attend, "lut_attention")), flush=True)

            def attend_at_centres():  # as a decode step calls it: the members by their centres' positions
                lut_attention_at_centres(s["query"], s["keys"], s["values"], s["positions"], s["lengths"],
                                         s["lut"][1], s["lut"][2], args.context, scaling, want_step=True,
                                         defer_step=True)
            print("\n".join(timed(attend_at_centres, "lut_attention_at_centres, step deferred")), flush=True)
        if args.only in (None, "d2o_step"):
            attention, threshold = s["state"][0], s["state"][1].zero_()  # tau 0: most steps merge

            def d2o():
                d2o_step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], attention, threshold,
                         s["n_keep"], 3, 1, 4, 0.7, False, True, newest_last=True)  # as after a decode pass
                s["lengths"].fill_(args.slots)
            print("\n".join(timed(d2o, "d2o_step")), flush=True)
        if args.only in (None, "d2o_observe_step"):
            attention, threshold = s["state"][0], s["state"][1].zero_()
            logits = torch.randn(args.rows, args.kv_heads * args.group, args.slots, device=device) * 2
            pending = triton_decode.PendingStep(logits, logits.logsumexp(-1), args.group, args.slots)

            def observe_then_step(fused: bool):
                if not fused:  # D2O's observe: the step attention's own launch
                    pending(into=attention)
                d2o_step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], attention, threshold,
                         s["n_keep"], 3, 1, 4, 0.7, False, True, newest_last=True, step=pending if fused else None)
                s["lengths"].fill_(args.slots)
            for fused in (False, True):
                label = "step attention in d2o_step's first launch" if fused else "step attention, then d2o_step"
                print("\n".join(timed(lambda: observe_then_step(fused), label)), flush=True)
        if args.only in (None, "cam_step"):
            attention = s["state"][0]

            def cam():  # CaM's defaults: StreamingLLM's victim, 16 targets, the counter-based draw
                cam_step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], attention, s["n_keep"],
                         4, None, 16, 12345, newest_last=True)
                s["lengths"].fill_(args.slots)
            print("\n".join(timed(cam, "cam_step")), flush=True)


if __name__ == "__main__":
    main()
