"""Probe (not product code): EMS's one-query look-up-table attention in ONE split-K pass plus the combine, with the
table's members kept in centre-slot order (CSR: the members of slot c are entries [offsets[c], offsets[c + 1])).

The committed ``triton_lut_attention`` needs five dependent launches (plus two for the centre map) because a member's
weight exp(rho_j l_c - M) needs its centre's logit l_c, computed by another program, and the row's max M over
slots and members. With the members of a split's slots contiguous, one program owns both its slots and their
members: (A) its slots' logits and norms into scratch; (B) its members' logits rho_j l_c gathered from that scratch,
their max, then their weights added onto their centres (relaxed atomics, inside the program); (C) W_c and the
split's partial sums over V; then ``triton_decode._decode_combine`` merges the splits. K, V and the members are read
once; the scratch stays in L2. This measures what the layout would buy on the critical path; keeping the members
in that order across decode steps (the merge re-points a segment, the slot move renumbers one) is not built here.

    python results/gpu/2026-11-30/logs/s20_csr_lut_probe.py --check     # correctness against the torch reference
    python results/gpu/2026-11-30/logs/s20_csr_lut_probe.py --slots 6555 --rows 1   # timings (CUDA)
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from kvbench.kernels import triton_decode
from kvbench.kernels.decode_attention import decode_attention
from kvbench.kernels.dispatch import use_backend
from kvbench.kernels.lut_attention import NORM_EPS, lut_attention
from kvbench.kernels.lut_expand import centre_slots
from kvbench.kernels.triton_decode import INTERPRETED, LOG2E, _decode_combine, split_plan

TILES = (128, 4, 3)
BLOCK_E = 512
ELL_TILES = (64, 4, 3)


@triton.jit
def _csr_partials(q_ptr, k_ptr, v_ptr, len_ptr, off_ptr, mslot_ptr, mnorm_ptr, logit_ptr, norm_ptr, mw_ptr,
                  m_ptr, l_ptr, acc_ptr, H, T, E, D, DV, split_size, n_splits, scaling, norm_eps,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK_E: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    split, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = row // H, row % H
    heads = tl.arange(0, BLOCK_M)
    head_ok = heads < GROUP
    q_rows = row * GROUP + heads
    d, dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :], mask=head_ok[:, None] & (d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    length = tl.load(len_ptr + row)
    start = split * split_size
    stop = tl.minimum(start + split_size, length)
    top = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for n0 in range(start, stop, BLOCK_N):  # (A) the split's logits and key norms, its members' weights zeroed
        cols = n0 + tl.arange(0, BLOCK_N)
        real = cols < stop
        k = tl.load(k_ptr + (row * T + cols[:, None]) * D + d[None, :], mask=real[:, None] & (d[None, :] < D),
                    other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
        s = tl.where(real[None, :], s, float("-inf"))
        at = q_rows[:, None] * T + cols[None, :]
        tl.store(logit_ptr + at, s, mask=head_ok[:, None] & real[None, :])
        tl.store(mw_ptr + at, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), mask=head_ok[:, None] & real[None, :])
        kf = k.to(tl.float32)
        tl.store(norm_ptr + row * T + cols, tl.sqrt(tl.sum(kf * kf, axis=1)), mask=real)
        top = tl.maximum(top, tl.max(s, 1))
    tl.debug_barrier()
    e0 = tl.load(off_ptr + row * (T + 1) + tl.minimum(start, length))
    e1 = tl.load(off_ptr + row * (T + 1) + tl.maximum(stop, tl.minimum(start, length)))
    for j0 in range(e0, e1, BLOCK_E):  # (B1) the members' largest logit
        j = j0 + tl.arange(0, BLOCK_E)
        ok = j < e1
        slot = tl.load(mslot_ptr + row * E + j, mask=ok, other=0)
        rho = tl.load(mnorm_ptr + row * E + j, mask=ok, other=0.0) / \
            tl.maximum(tl.load(norm_ptr + row * T + slot, mask=ok, other=1.0, cache_modifier=".cg"), norm_eps)
        both = head_ok[:, None] & ok[None, :]
        l = tl.load(logit_ptr + q_rows[:, None] * T + slot[None, :], mask=both, other=0.0, cache_modifier=".cg")
        top = tl.maximum(top, tl.max(tl.where(both, rho[None, :] * l, float("-inf")), 1))
    ref = tl.where(top == float("-inf"), 0.0, top)
    for j0 in range(e0, e1, BLOCK_E):  # (B2) their weights onto their centres
        j = j0 + tl.arange(0, BLOCK_E)
        ok = j < e1
        slot = tl.load(mslot_ptr + row * E + j, mask=ok, other=0)
        rho = tl.load(mnorm_ptr + row * E + j, mask=ok, other=0.0) / \
            tl.maximum(tl.load(norm_ptr + row * T + slot, mask=ok, other=1.0, cache_modifier=".cg"), norm_eps)
        both = head_ok[:, None] & ok[None, :]
        l = tl.load(logit_ptr + q_rows[:, None] * T + slot[None, :], mask=both, other=0.0, cache_modifier=".cg")
        tl.atomic_add(mw_ptr + q_rows[:, None] * T + slot[None, :], tl.exp(rho[None, :] * l - ref[:, None]),
                      mask=both, sem="relaxed")
    tl.debug_barrier()
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    for n0 in range(start, stop, BLOCK_N):  # (C) W_c = exp(l_c - ref) + its members' weights, sum W v
        cols = n0 + tl.arange(0, BLOCK_N)
        real = cols < stop
        at = q_rows[:, None] * T + cols[None, :]
        tile = head_ok[:, None] & real[None, :]
        w = tl.exp(tl.load(logit_ptr + at, mask=tile, other=float("-inf"), cache_modifier=".cg") - ref[:, None]) + \
            tl.load(mw_ptr + at, mask=tile, other=0.0, cache_modifier=".cg")
        total += tl.sum(w, 1)
        v = tl.load(v_ptr + (row * T + cols[:, None]) * DV + dv[None, :], mask=real[:, None] & (dv[None, :] < DV),
                    other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc += tl.dot(w.to(v.dtype), v, input_precision=PRECISION)
        tl.store(logit_ptr + at, w, mask=tile)  # W for the step attention's launch (not made here)
    part = q_rows * n_splits + split  # _decode_combine's layout: (b * H_q + query head, split), max in log2 units
    tl.store(m_ptr + part, top * 1.4426950408889634, mask=head_ok)
    tl.store(l_ptr + part, total, mask=head_ok)
    tl.store(acc_ptr + part[:, None] * BLOCK_DV + dv[None, :], acc, mask=head_ok[:, None])


@triton.jit
def _ell_partials(q_ptr, k_ptr, v_ptr, len_ptr, ell_ptr, m_ptr, l_ptr, acc_ptr, H, T, D, DV, split_size, n_splits,
                  scaling, norm_eps, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Flash-decoding over the slots where each slot also carries up to K members' norms (-1: none): slot c weighs
    exp(l_c - m) + sum_k exp(rho_ck l_c - m) inside the online softmax; no gathers, no atomics, one pass."""
    split, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    heads = tl.arange(0, BLOCK_M)
    head_ok = heads < GROUP
    q_rows = row * GROUP + heads
    d, dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :], mask=head_ok[:, None] & (d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    length = tl.load(len_ptr + row)
    start = split * split_size
    stop = tl.minimum(start + split_size, length)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        real = cols < stop
        k = tl.load(k_ptr + (row * T + cols[:, None]) * D + d[None, :], mask=real[:, None] & (d[None, :] < D),
                    other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
        s = tl.where(real[None, :], s, float("-inf"))
        kf = k.to(tl.float32)
        inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(kf * kf, axis=1)), norm_eps)
        top = tl.max(s, 1)
        for kk in tl.static_range(K):
            member = tl.load(ell_ptr + (row * T + cols) * K + kk, mask=real, other=-1.0)
            ml = tl.where((member >= 0)[None, :], s * (member * inv)[None, :], float("-inf"))
            top = tl.maximum(top, tl.max(ml, 1))
        m_new = tl.maximum(m, top)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - ref)
        w = tl.exp(s - ref[:, None])
        for kk in tl.static_range(K):
            member = tl.load(ell_ptr + (row * T + cols) * K + kk, mask=real, other=-1.0)
            ml = tl.where((member >= 0)[None, :], s * (member * inv)[None, :], float("-inf"))
            w += tl.exp(ml - ref[:, None])
        v = tl.load(v_ptr + (row * T + cols[:, None]) * DV + dv[None, :], mask=real[:, None] & (dv[None, :] < DV),
                    other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(w.to(v.dtype), v, input_precision=PRECISION)
        total = total * alpha + tl.sum(w, 1)
        m = m_new
    part = q_rows * n_splits + split
    tl.store(m_ptr + part, m * 1.4426950408889634, mask=head_ok)
    tl.store(l_ptr + part, total, mask=head_ok)
    tl.store(acc_ptr + part[:, None] * BLOCK_DV + dv[None, :], acc, mask=head_ok[:, None])


def ell(slot, norm, live, T: int, K: int):
    """(B, H, T, K) float32: the norms of each slot's first K members (-1: none), and how many members overflow."""
    offsets, mslot, mnorm = csr(slot, norm, live, T)
    rank = torch.arange(mslot.shape[-1], device=slot.device) - offsets.gather(-1, mslot.clamp(max=T))
    keep = (mslot < T) & (rank < K)
    out = torch.full((*slot.shape[:2], T * K + 1), -1.0, device=slot.device)
    out.scatter_(-1, torch.where(keep, mslot * K + rank, T * K), torch.where(keep, mnorm, -1.0))
    return out[..., :T * K].reshape(*slot.shape[:2], T, K).contiguous(), int(((mslot < T) & ~keep).sum())


def ell_lut_attention(query, keys, values, lengths, ell_norms, scaling):
    B, Hq, _, D = query.shape
    H, T, DV, K = keys.shape[1], keys.shape[2], values.shape[-1], ell_norms.shape[-1]
    block_n, warps, stages = ELL_TILES
    split_size, n_splits = split_plan(T, B * H, query.device, block_n)
    f32 = dict(dtype=torch.float32, device=query.device)
    block_dv = max(16, triton.next_power_of_2(DV))
    m, l = torch.empty(B * Hq * n_splits, **f32), torch.empty(B * Hq * n_splits, **f32)
    acc = torch.empty(B * Hq * n_splits, block_dv, **f32)
    _ell_partials[(n_splits, B * H)](
        query, keys, values, lengths, ell_norms, m, l, acc, H, T, D, DV, split_size, n_splits, scaling, NORM_EPS,
        K=K, GROUP=Hq // H, BLOCK_M=max(16, triton.next_power_of_2(Hq // H)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_DV=block_dv, UPCAST=INTERPRETED,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
    out = query.new_empty(B, Hq, 1, DV)
    lse = torch.empty(B * Hq, **f32)
    _decode_combine[(B * Hq,)](m, l, acc, out, lse, out.stride(0), out.stride(1), out.stride(3), Hq, DV, n_splits,
                               BLOCK_S=max(2, triton.next_power_of_2(n_splits)), BLOCK_DV=block_dv)
    return out


def csr(slot: torch.Tensor, norm: torch.Tensor, live: torch.Tensor, T: int):
    """The table in centre-slot order: (offsets (B, H, T + 1) int64, slots (B, H, E) int64, norms (B, H, E))."""
    key = torch.where(live, slot, T)
    order = key.argsort(dim=-1, stable=True)
    counts = torch.zeros(*slot.shape[:2], T + 1, dtype=torch.long, device=slot.device)
    counts.scatter_add_(-1, key, torch.ones_like(key))
    offsets = torch.cat([torch.zeros_like(counts[..., :1]), counts[..., :T].cumsum(-1)], -1)
    return offsets.contiguous(), key.gather(-1, order).contiguous(), norm.float().gather(-1, order).contiguous()


def csr_lut_attention(query, keys, values, lengths, offsets, mslot, mnorm, scaling):
    B, Hq, _, D = query.shape
    H, T, DV, E = keys.shape[1], keys.shape[2], values.shape[-1], mslot.shape[-1]
    group = Hq // H
    block_n, warps, stages = TILES
    split_size, n_splits = split_plan(T, B * H, query.device, block_n)
    f32 = dict(dtype=torch.float32, device=query.device)
    logits, mw, norms = torch.empty(B, Hq, T, **f32), torch.empty(B, Hq, T, **f32), torch.empty(B, H, T, **f32)
    block_dv = max(16, triton.next_power_of_2(DV))
    m, l = torch.empty(B * Hq * n_splits, **f32), torch.empty(B * Hq * n_splits, **f32)
    acc = torch.empty(B * Hq * n_splits, block_dv, **f32)
    _csr_partials[(n_splits, B * H)](
        query, keys, values, lengths, offsets, mslot, mnorm, logits, norms, mw, m, l, acc, H, T, E, D, DV,
        split_size, n_splits, scaling, NORM_EPS, GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_DV=block_dv, BLOCK_E=BLOCK_E,
        UPCAST=INTERPRETED, PRECISION="ieee" if query.dtype == torch.float32 else "tf32", num_warps=warps,
        num_stages=stages)
    out = query.new_empty(B, Hq, 1, DV)
    lse = torch.empty(B * Hq, **f32)
    _decode_combine[(B * Hq,)](m, l, acc, out, lse, out.stride(0), out.stride(1), out.stride(3), Hq, DV, n_splits,
                               BLOCK_S=max(2, triton.next_power_of_2(n_splits)), BLOCK_DV=block_dv)
    return out


def check(device) -> None:
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for B, H, group, T, E, D, dtype in [(1, 2, 4, 300, 700, 64, torch.float32), (2, 3, 1, 37, 70, 16, torch.float32),
                                        (1, 2, 4, 1000, 3000, 64, torch.bfloat16), (1, 1, 1, 1, 1, 16, torch.float32)]:
        query = torch.randn(B, H * group, 1, D, generator=g).to(dtype)
        keys = (torch.randn(B, H, T, D, generator=g) * 2).to(dtype)
        values = torch.randn(B, H, T, D, generator=g).to(dtype)
        lengths = torch.randint(1, T + 1, (B, H), generator=g)
        live = torch.rand(B, H, E, generator=g) < 0.6
        slot = (torch.rand(B, H, E, generator=g) * lengths.unsqueeze(-1)).long()
        norm = torch.where(live, torch.rand(B, H, E, generator=g) * 3 * D ** 0.5, -1.0)
        args = [x.to(device) for x in (query, keys, values, lengths, slot, norm, live)]
        with use_backend("torch"):
            ref, _ = lut_attention(*args, D ** -0.5)
        offsets, mslot, mnorm = csr(args[4], args[5], args[6], T)
        out = csr_lut_attention(*args[:4], offsets, mslot, mnorm, D ** -0.5)
        ell_norms, overflow = ell(args[4], args[5], args[6], T, 64)
        assert overflow == 0, overflow
        for name, new in (("csr", out), ("ell", ell_lut_attention(*args[:4], ell_norms, D ** -0.5))):
            err = ((new.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            worst = max(worst, err / (1e-5 if dtype == torch.float32 and device.type == "cpu" else 2e-2))
            print(f"  check {name} B{B} H{H} g{group} T{T} E{E} {dtype}: max error / max |out| = {err:.2e}")
    print(f"check: worst error / its tolerance (1e-5 float32 on the CPU, else 2e-2) = {worst:.2f}")
    if worst > 1:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--slots", type=int, default=6555)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--table-fill", type=float, default=0.9)
    parser.add_argument("--engine-paths", action="store_true",
                        help="time only the committed path and lut_attention_at_centres (the map in its launches)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.check:
        return check(device)
    from scripts.bench_ems_kernels import timed  # graph replay, the profiler's per-kernel times

    g = torch.Generator().manual_seed(0)
    B, H, group, T, D = args.rows, 8, 4, args.slots, 128
    E = 3 * (T - 1)
    positions = torch.sort(torch.randperm(args.context - 1, generator=g)[:T]).values.expand(B, H, T).contiguous()
    live0 = torch.rand(B, H, E, generator=g) < args.table_fill
    centre = torch.where(live0, positions.gather(2, torch.randint(0, T, (B, H, E), generator=g)), -1)
    query = torch.randn(B, H * group, 1, D, generator=g).to(device, torch.bfloat16)
    keys = torch.randn(B, H, T, D, generator=g).to(device, torch.bfloat16)
    values = torch.randn(B, H, T, D, generator=g).to(device, torch.bfloat16)
    lengths = torch.full((B, H), T, device=device)
    positions, centre = positions.to(device), centre.to(device)
    norm = (torch.rand(B, H, E, generator=g) * 20).to(device)
    scaling = D ** -0.5
    query_pos = torch.full((B, 1), args.context, device=device)
    slot, live = centre_slots(positions, lengths, centre, args.context)
    offsets, mslot, mnorm = csr(slot, norm, live, T)
    ref, _ = lut_attention(query, keys, values, lengths, slot, norm, live, scaling)
    new = csr_lut_attention(query, keys, values, lengths, offsets, mslot, mnorm, scaling)
    print(f"== {B} rows x {H} heads x {T} slots, {int(live.sum()) // (B * H)} live members a head; "
          f"max |new - committed| / max |committed| = "
          f"{((new.float() - ref.float()).abs().max() / ref.float().abs().max()).item():.2e}")

    def committed():  # as a decode step's critical path runs it: the centre map, then the output's launches
        s, lv = centre_slots(positions, lengths, centre, args.context)
        lut_attention(query, keys, values, lengths, s, norm, lv, scaling, want_step=True, defer_step=True)

    print("\n".join(timed(committed, "committed (centre map + lut_attention, step deferred)")))
    if args.engine_paths:
        from kvbench.kernels.lut_attention import lut_attention_at_centres

        print("\n".join(timed(lambda: lut_attention_at_centres(query, keys, values, positions, lengths, centre, norm,
                                                               args.context, scaling, want_step=True,
                                                               defer_step=True),
                              "lut_attention_at_centres (the map in launches 1 and 2, step deferred)")))
        return
    print("\n".join(timed(lambda: csr_lut_attention(query, keys, values, lengths, offsets, mslot, mnorm, scaling),
                          "CSR one pass + combine")))
    global ELL_TILES
    for K in (4, 8):
        ell_norms, overflow = ell(slot, norm, live, T, K)
        print(f"  ELL K={K}: {overflow} of {int(live.sum())} members past K (not attended here)")
        for ELL_TILES in ((64, 4, 3), (128, 8, 3)):
            print("\n".join(timed(lambda: ell_lut_attention(query, keys, values, lengths, ell_norms, scaling),
                                  f"ELL one pass + combine, K={K}, tiles {ELL_TILES}")))
    print("\n".join(timed(lambda: decode_attention(query, keys, values, lengths, positions, query_pos, scaling, T),
                          "decode_attention over the slots alone (no members)")))


if __name__ == "__main__":
    main()
