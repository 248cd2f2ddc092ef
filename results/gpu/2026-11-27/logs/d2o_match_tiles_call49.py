"""Call 49: D2O's best-match launch (``triton_d2o_step._match_kernel``) alone, over launch shapes, at the two
shapes of the A/B sets (64k at batch 1: 8 rows of 13.2k slots; 16k, 2 rows a point: 16 rows of 3.3k), keys
bf16, d 128.

Call 47 measured the launch at ~35 us whatever the row length (1.18 ms / 32 at 64k, 3.33 ms / 96 at 16k), i.e.
fixed per-program latency in several waves, not bandwidth (27 MB a layer at 64k is ~6 us at 4.8 TB/s). Each
row is timed as 32 launches captured in one CUDA graph (one per layer), replayed; a variant divides the dot
product by the key's norm instead of normalising every element (``dot``), which rounds differently (a few
float32 ulps of the cosine) and is reported with its largest cosine difference.

In call 49 the ``dot`` form was this script's own kernel; it landed as ``triton_d2o_step._match_kernel``
(``cdff820``), so the script now reads the ``norm`` form from a copy of the code before it:

    git archive fa53334 kvbench conf | tar -x -C old_fa53334
    PYTHONPATH=/tmp/site:. python3 results/gpu/2026-11-27/logs/d2o_match_tiles_call49.py
"""
import importlib.util
import itertools
import os
import sys
from pathlib import Path

import torch
import triton

from kvbench.kernels import triton_d2o_step as d2o
from kvbench.kernels import triton_slots
from kvbench.kernels.triton_slots import BLOCK_SCAN, block_size

# a CPU dry run of the script (TRITON_INTERPRET=1, tiny shapes, no timing): DRY=1
DRY = os.environ.get("DRY") == "1"
DEVICE = "cpu" if DRY else "cuda"
# programs per multiprocessor, keys per tile, warps, pipeline stages
SPACE = ((1, 2), (32,), (4,), (2,)) if DRY else ((1, 2, 4, 8), (32, 64, 128), (4, 8), (2, 3))


def old_match_kernel():
    """``_match_kernel`` of the copy of ``fa53334`` (every key element divided by the key's norm): the form call 49
    measured as "norm"."""
    path = Path.cwd() / os.environ.get("KVBENCH_OLD", "old_fa53334") / "kvbench" / "kernels" / "triton_d2o_step.py"
    spec = importlib.util.spec_from_file_location("old_triton_d2o_step", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module._match_kernel


def setup(rows_b, C, length, D=128):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    B, H = rows_b, 8
    keys = torch.randn(B, H, C, D, device=DEVICE, generator=g).to(torch.bfloat16)
    positions = torch.arange(C, device=DEVICE).expand(B, H, C).contiguous()
    lengths = torch.full((B, H), length, dtype=torch.long, device=DEVICE)
    attention = torch.rand(B, H, C, device=DEVICE, generator=g)
    n_keep = torch.full((B,), length - 1, dtype=torch.long, device=DEVICE)
    rows = B * H
    VNB, vspan = triton_slots.row_blocks(rows, C, BLOCK_SCAN, keys.device)
    newest = triton_slots.newest_by_blocks(positions, lengths, VNB, vspan)
    low = torch.empty(rows * VNB, dtype=torch.float32, device=DEVICE)
    low_pos, low_slot = (torch.empty(rows * VNB, dtype=torch.long, device=DEVICE) for _ in range(2))
    d2o._victim_kernel[(rows, VNB)](attention, positions, lengths, n_keep, newest, low, low_pos, low_slot, H, C, vspan,
                                    VNB, 3, 1, 4, BLOCK_C=BLOCK_SCAN, BLOCK_NB=block_size(VNB))
    return dict(keys=keys, positions=positions, lengths=lengths, low=low, low_pos=low_pos, low_slot=low_slot,
                rows=rows, C=C, D=D, VNB=VNB)


def launcher(kernel, s, per_sm, block_s, warps, stages):
    programs = per_sm * (2 if DRY else torch.cuda.get_device_properties(0).multi_processor_count)
    wanted = max(1, min(triton.cdiv(programs, s["rows"]), triton.cdiv(s["C"], block_s)))
    span = triton.cdiv(triton.cdiv(s["C"], wanted), block_s) * block_s
    NB = triton.cdiv(s["C"], span)
    out = torch.empty(s["rows"], NB, device=DEVICE), *(torch.empty(s["rows"], NB, dtype=torch.long, device=DEVICE)
                                                         for _ in range(2))

    def launch():
        kernel[(s["rows"], NB)](s["keys"], s["positions"], s["lengths"], s["low"], s["low_pos"], s["low_slot"], *out,
                                s["C"], s["D"], span, NB, s["VNB"], BLOCK_S=block_s, BLOCK_D=block_size(s["D"]),
                                BLOCK_VNB=block_size(s["VNB"]), num_warps=warps, num_stages=stages)
    return launch, out, NB, span


def timed(launch, layers=32, replays=20):
    launch()
    if DRY:
        return float("nan")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        for _ in range(layers):
            launch()
        graph.capture_end()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays / layers  # us per launch


def main():
    shapes = {"64k b1": (1, 13171, 13170), "16k 2 rows": (2, 3264, 3263)}
    if DRY:
        shapes = {"dry": (1, 300, 290)}
    else:
        print(torch.cuda.get_device_name(), "SMs", torch.cuda.get_device_properties(0).multi_processor_count)
    for name, (b, C, length) in shapes.items():
        s = setup(b, C, length)
        old = old_match_kernel()
        ref_launch, ref_out, _, _ = launcher(old, s, d2o_programs(), d2o.BLOCK_S, d2o.WARPS, 3)
        ref_launch()
        if not DRY:
            torch.cuda.synchronize()
        reference = ref_out[0].max(1).values.clone(), ref_out[2].clone()
        print(f"== {name}: rows {s['rows']}, C {C}, bytes a launch {s['keys'].numel() * 2 / 1e6:.1f} MB")
        print("kernel  per_sm  block_s  warps  stages  blocks  span  us/launch  max |dcos|  same match")
        for kernel_name, kernel in (("norm", old), ("dot", d2o._match_kernel)):
            for per_sm, block_s, warps, stages in itertools.product(*SPACE):
                try:
                    launch, out, NB, span = launcher(kernel, s, per_sm, block_s, warps, stages)
                    us = timed(launch)
                except Exception as error:  # a shape that does not compile (shared memory) is reported, not fatal
                    print(f"{kernel_name:>6} {per_sm:>7} {block_s:>8} {warps:>6} {stages:>7}  failed: {error!r:.80}")
                    continue
                high = out[0].max(1).values
                # the row's match: the block holding the best (ties to the oldest position)
                diff = float((high - reference[0]).abs().max())
                same = bool(torch.equal(pick(out), pick((ref_out[0], ref_out[1], ref_out[2]))))
                print(f"{kernel_name:>6} {per_sm:>7} {block_s:>8} {warps:>6} {stages:>7} {NB:>7} {span:>5} "
                      f"{us:>10.2f} {diff:>11.2e} {same!s:>11}")


def pick(out):
    """(rows,) the slot of each row's best block result, ties to the oldest position (``best_of_blocks``)."""
    sim, pos, slot = out
    high = sim.max(1, keepdim=True).values
    first = torch.where(sim == high, pos, 1 << 62).min(1, keepdim=True).values
    return torch.where((sim == high) & (pos == first), slot, 1 << 62).min(1).values


def d2o_programs():
    return triton_slots.PROGRAMS_PER_SM


if __name__ == "__main__":
    main()
