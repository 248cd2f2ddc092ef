"""Twenty-first session's probe: EMS's one-query look-up-table attention as a decode step runs it
(``lut_attention_at_centres``, step attention deferred), the five launches of ``831d39e`` (a copy of that module at
``ab/old_triton_lut_attention.py``, loaded beside the new one) against the four launches of the working tree, one
process, graph replay (``scripts.bench_ems_kernels.timed``), at the engine's shapes:

    mkdir -p ab && git show 831d39e:kvbench/kernels/triton_lut_attention.py > ab/old_triton_lut_attention.py
    python3 results/gpu/2026-11-30/logs/s21_lut_ab.py --rows 1 --slots 6555 --context 32768

``--variants v2`` also times ``ab/v2_triton_lut_attention.py``: the working tree's module with ``s21_lut_v2.patch``
applied (call 3's launch 3, an online softmax), with ``triton_decode``'s online-softmax tile copied in;
``s21_next_call.sh`` makes ``ab/`` from the committed module and ``s21_lut_interleaved.patch``.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

from kvbench.kernels import triton_lut_attention
from scripts.bench_ems_kernels import timed


def old_module(name: str = "old"):
    spec = importlib.util.spec_from_file_location(f"{name}_triton_lut_attention", f"ab/{name}_triton_lut_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--slots", type=int, default=6555)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--table-fill", type=float, default=0.9)
    parser.add_argument("--base-label", default="committed (five launches)", help="ab/old_...'s label")
    parser.add_argument("--new-label", default="new (four launches)", help="the working tree's label")
    parser.add_argument("--variants", default="", help="also time ab/NAME_triton_lut_attention.py, e.g. v1,v2")
    parser.add_argument("--tiles", default="", help="more LUT_TILES of the new path, e.g. 64:4:3,128:8:3")
    args = parser.parse_args()
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    B, H, group, T, D = args.rows, 8, 4, args.slots, 128
    E = 3 * (T - 1)
    positions = torch.sort(torch.randperm(args.context - 1, generator=g)[:T]).values.expand(B, H, T).contiguous()
    live = torch.rand(B, H, E, generator=g) < args.table_fill
    centre = torch.where(live, positions.gather(2, torch.randint(0, T, (B, H, E), generator=g)), -1).to(device)
    query = torch.randn(B, H * group, 1, D, generator=g).to(device, torch.bfloat16)
    keys = torch.randn(B, H, T, D, generator=g).to(device, torch.bfloat16)
    values = torch.randn(B, H, T, D, generator=g).to(device, torch.bfloat16)
    lengths = torch.full((B, H), T, device=device)
    positions = positions.to(device)
    norm = (torch.rand(B, H, E, generator=g) * 20).to(device)
    scaling = D ** -0.5
    paths = {args.base_label: old_module().lut_attention_at_centres,
             args.new_label: triton_lut_attention.lut_attention_at_centres}
    for name in filter(None, args.variants.split(",")):  # v1: call 2's four launches; v2: call 3's
        paths[name] = old_module(name).lut_attention_at_centres
    results = {}
    for label, attend in paths.items():
        results[label] = attend(query, keys, values, positions, lengths, centre, norm, args.context, scaling,
                                want_step=True)
    (o0, s0), (o1, s1) = list(results.values())[:2]
    print(f"== {B} rows x {H} heads x {T} slots, {int(live.sum()) // (B * H)} live members a head; "
          f"output max |new - committed| / max |committed| = "
          f"{((o1.float() - o0.float()).abs().max() / o0.float().abs().max()).item():.2e}, step attention "
          f"{((s1 - s0).abs().max() / s0.abs().max()).item():.2e}")
    for _ in range(2):  # interleaved
        for label, attend in paths.items():
            print("\n".join(timed(lambda: attend(query, keys, values, positions, lengths, centre, norm, args.context,
                                                 scaling, want_step=True, defer_step=True), label)))
    committed_tiles = triton_lut_attention.LUT_TILES
    for tiles in filter(None, args.tiles.split(",")):
        triton_lut_attention.LUT_TILES = tuple(int(v) for v in tiles.split(":"))
        print("\n".join(timed(lambda: triton_lut_attention.lut_attention_at_centres(
            query, keys, values, positions, lengths, centre, norm, args.context, scaling, want_step=True,
            defer_step=True), f"new, LUT_TILES {tiles}")))
    triton_lut_attention.LUT_TILES = committed_tiles


if __name__ == "__main__":
    main()
