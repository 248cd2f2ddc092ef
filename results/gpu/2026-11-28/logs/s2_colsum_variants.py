"""Column-sum kernel variants at one layer's shape (scratch, GPU): which structure approaches the bound."""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl
import triton.testing

from kvbench.kernels import triton_attention
from kvbench.kernels.column_sums import causal_attention_lse

LOG2E = 1.4426950408889634


@triton.jit
def _colsum_v(
    q_ptr, k_ptr, lse_ptr, kpos_ptr, qpos_ptr, col_ptr, win_ptr,
    sqb, sqh, sqq, sqd, skb, skh, skt, skd, slb, slh, slq,
    H_kv, Q, T, D, scale_log2, window_start,
    GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, PREFETCH: tl.constexpr, REVERSE: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    pid_n = tl.program_id(0)
    if REVERSE:
        pid_n = tl.num_programs(0) - 1 - pid_n
    b, hkv = pid_bh // H_kv, pid_bh % H_kv
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    k = tl.load(k_ptr + b * skb + hkv * skh + cols[:, None] * skt + d[None, :] * skd,
                mask=(cols[:, None] < T) & (d[None, :] < D), other=0.0)
    kpos = tl.load(kpos_ptr + pid_bh * T + cols, mask=cols < T, other=2147483647)
    first_visible = tl.min(kpos)
    lo = 0
    hi = Q
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        before = tl.load(qpos_ptr + b * Q + tl.minimum(mid, Q - 1)) < first_visible
        lo = tl.where((lo < hi) & before, mid + 1, lo)
        hi = tl.where((lo < hi) & ~before, mid, hi)
    start = (lo // BLOCK_M) * BLOCK_M
    last_key = tl.max(tl.where(cols < T, kpos, -1))
    col = tl.zeros((BLOCK_N,), tl.float32)
    win = tl.zeros((BLOCK_N,), tl.float32)
    r = tl.arange(0, HEADS * BLOCK_M)
    rh = r // BLOCK_M
    ri = r % BLOCK_M
    n_tiles = tl.cdiv(Q - start, BLOCK_M)
    n_iter = n_tiles * (GROUP // HEADS)
    lse_scale = 1.4426950408889634
    if PREFETCH:
        gi = 0
        qi = start + ri
        q = tl.load(q_ptr + b * sqb + (hkv * GROUP + rh)[:, None] * sqh + qi[:, None] * sqq + d[None, :] * sqd,
                    mask=(qi < Q)[:, None] & (d[None, :] < D), other=0.0)
        s = tl.dot(k, tl.trans(q))
        for t in range(n_iter):
            g0 = (t // n_tiles) * HEADS
            i0 = start + (t % n_tiles) * BLOCK_M
            qi = i0 + ri
            row_ok = qi < Q
            hq = hkv * GROUP + g0 + rh
            tn = t + 1
            gn = (tn // n_tiles) * HEADS
            inx = start + (tn % n_tiles) * BLOCK_M + ri
            okn = (inx < Q) & ((ri * 0 + tn) < n_iter)
            qn = tl.load(q_ptr + b * sqb + (hkv * GROUP + gn + rh)[:, None] * sqh + inx[:, None] * sqq + d[None, :] * sqd,
                         mask=okn[:, None] & (d[None, :] < D), other=0.0)
            s_next = tl.dot(k, tl.trans(qn))
            qpos = tl.load(qpos_ptr + b * Q + qi, mask=row_ok, other=-1)
            lse = tl.load(lse_ptr + b * slb + hq * slh + qi * slq, mask=row_ok, other=float("inf"))
            p = tl.exp2(s * scale_log2 - (lse * lse_scale)[None, :])
            if tl.min(qpos) < last_key:
                p = tl.where(kpos[:, None] <= qpos[None, :], p, 0.0)
            col += tl.sum(p, 1)
            if i0 + BLOCK_M > window_start:
                win += tl.sum(tl.where((qi >= window_start)[None, :], p, 0.0), 1)
            s = s_next
    else:
        for t in range(n_iter):
            g0 = (t // n_tiles) * HEADS
            i0 = start + (t % n_tiles) * BLOCK_M
            qi = i0 + ri
            row_ok = qi < Q
            hq = hkv * GROUP + g0 + rh
            q = tl.load(q_ptr + b * sqb + hq[:, None] * sqh + qi[:, None] * sqq + d[None, :] * sqd,
                        mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
            qpos = tl.load(qpos_ptr + b * Q + qi, mask=row_ok, other=-1)
            lse = tl.load(lse_ptr + b * slb + hq * slh + qi * slq, mask=row_ok, other=float("inf"))
            s = tl.dot(k, tl.trans(q))
            p = tl.exp2(s * scale_log2 - (lse * lse_scale)[None, :])
            if tl.min(qpos) < last_key:
                p = tl.where(kpos[:, None] <= qpos[None, :], p, 0.0)
            col += tl.sum(p, 1)
            if i0 + BLOCK_M > window_start:
                win += tl.sum(tl.where((qi >= window_start)[None, :], p, 0.0), 1)
    tl.store(col_ptr + pid_bh * T + cols, col / GROUP, mask=cols < T)
    tl.store(win_ptr + pid_bh * T + cols, win / GROUP, mask=cols < T)


@triton.jit
def _colsum_n(
    q_ptr, k_ptr, lse_ptr, kpos_ptr, qpos_ptr, col_ptr, win_ptr,
    sqb, sqh, sqq, sqd, skb, skh, skt, skd, slb, slh, slq,
    H_kv, Q, T, D, scale_log2, window_start,
    GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, WS: tl.constexpr, LSE2: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b, hkv = pid_bh // H_kv, pid_bh % H_kv
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    k = tl.load(k_ptr + b * skb + hkv * skh + cols[:, None] * skt + d[None, :] * skd,
                mask=(cols[:, None] < T) & (d[None, :] < D), other=0.0)
    kpos = tl.load(kpos_ptr + pid_bh * T + cols, mask=cols < T, other=2147483647)
    first_visible = tl.min(kpos)
    lo = 0
    hi = Q
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        before = tl.load(qpos_ptr + b * Q + tl.minimum(mid, Q - 1)) < first_visible
        lo = tl.where((lo < hi) & before, mid + 1, lo)
        hi = tl.where((lo < hi) & ~before, mid, hi)
    start = (lo // BLOCK_M) * BLOCK_M
    last_key = tl.max(tl.where(cols < T, kpos, -1))
    col = tl.zeros((BLOCK_N,), tl.float32)
    win = tl.zeros((BLOCK_N,), tl.float32)
    r = tl.arange(0, HEADS * BLOCK_M)
    rh = r // BLOCK_M
    ri = r % BLOCK_M
    for g0 in range(0, GROUP, HEADS):
        hq = hkv * GROUP + g0 + rh
        for i0 in tl.range(start, Q, BLOCK_M, warp_specialize=WS):
            qi = i0 + ri
            row_ok = qi < Q
            q = tl.load(q_ptr + b * sqb + hq[:, None] * sqh + qi[:, None] * sqq + d[None, :] * sqd,
                        mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
            qpos = tl.load(qpos_ptr + b * Q + qi, mask=row_ok, other=-1)
            lse = tl.load(lse_ptr + b * slb + hq * slh + qi * slq, mask=row_ok, other=float("inf"))
            if LSE2:
                s = tl.dot(k, tl.trans(q)) * scale_log2 - lse[None, :]
            else:
                s = tl.dot(k, tl.trans(q)) * scale_log2 - lse[None, :] * 1.4426950408889634
            p = tl.exp2(s)
            if tl.min(qpos) < last_key:
                p = tl.where(kpos[:, None] <= qpos[None, :], p, 0.0)
            col += tl.sum(p, 1)
            if i0 + BLOCK_M > window_start:
                win += tl.sum(tl.where((qi >= window_start)[None, :], p, 0.0), 1)
    tl.store(col_ptr + pid_bh * T + cols, col / GROUP, mask=cols < T)
    tl.store(win_ptr + pid_bh * T + cols, win / GROUP, mask=cols < T)


def run_nested(q, k, lse, kpos, qpos, scale, window, heads, bm, bn, warps, stages, ws, lse2):
    B, Hq, Q, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    col = torch.empty(B, Hkv, T, dtype=torch.float32, device=q.device)
    win = torch.empty_like(col)
    _colsum_n[(triton.cdiv(T, bn), B * Hkv)](
        q, k, lse, kpos, qpos, col, win, *q.stride(), *k.stride(), *lse.stride(),
        Hkv, Q, T, D, scale * LOG2E, Q - window if window > 0 else Q,
        GROUP=Hq // Hkv, HEADS=heads, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=D, SEARCH_STEPS=max(1, Q.bit_length()),
        WS=ws, LSE2=lse2, num_warps=warps, num_stages=stages)
    return col, win


def run_variant(q, k, lse, kpos, qpos, scale, window, heads, bm, bn, warps, stages, prefetch, reverse):
    B, Hq, Q, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    group = Hq // Hkv
    col = torch.empty(B, Hkv, T, dtype=torch.float32, device=q.device)
    win = torch.empty_like(col)
    grid = (triton.cdiv(T, bn), B * Hkv)
    _colsum_v[grid](
        q, k, lse, kpos, qpos, col, win, *q.stride(), *k.stride(), *lse.stride(),
        Hkv, Q, T, D, scale * LOG2E, Q - window if window > 0 else Q,
        GROUP=group, HEADS=heads, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=D, SEARCH_STEPS=max(1, Q.bit_length()),
        PREFETCH=prefetch, REVERSE=reverse, num_warps=warps, num_stages=stages)
    return col, win


def nested_main(args) -> None:
    n, hq, hkv, d = args.length, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = d ** -0.5
    ms = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    import torch.nn.functional as F
    kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    rows = [("sdpa causal enable_gqa (full cache)", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)),
            ("sdpa causal repeated kv", lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=scale)),
            ("causal_attention_lse (repeat + cudnn)", lambda: causal_attention_lse(q, k, v, scale)),
            ("repeat_interleave k and v", lambda: (k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))),
            ("cudnn lse op (repeated kv)", lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, kr, vr, None, True, 0.0, True, False, scale=scale)),
            ("flash lse op (repeated kv)", lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, kr, vr, 0.0, True, False, scale=scale)),
            ("efficient lse op (gqa?)", lambda: torch.ops.aten._scaled_dot_product_efficient_attention(q, kr, vr, None, True, 0.0, True, scale=scale))]
    for name, fn in rows:
        try:
            print(f"  {ms(fn):8.3f} ms  {name}", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"  failed {name}: {str(exc)[:100]}", flush=True)
    _, lse = causal_attention_lse(q, k, v, scale)
    lse = lse.float().contiguous()
    lse2 = (lse * LOG2E).contiguous()
    pos = torch.arange(n, device="cuda").view(1, n)
    key_pos = pos.view(1, 1, n).expand(1, hkv, n)
    valid = torch.ones(1, hkv, n, dtype=torch.bool, device="cuda")
    kpos, qpos = triton_attention._masked_positions(valid, key_pos, pos)
    ref_col, ref_win = triton_attention.column_sums_from_lse(q, k, lse, valid, key_pos, pos, scale, 32)
    t_cur = ms(lambda: triton_attention.column_sums_from_lse(q, k, lse, valid, key_pos, pos, scale, 32))
    print(f"  {t_cur:8.3f} ms  current column sums", flush=True)
    configs = [(h, bm, bn, w, st, ws, l2) for ws in (False, True) for l2 in (False, True)
               for (h, bm, bn, w) in ((1, 64, 128, 4), (2, 64, 128, 4), (1, 128, 128, 4), (2, 64, 128, 8),
                                      (1, 128, 128, 8), (4, 64, 128, 8), (2, 64, 64, 4), (1, 64, 256, 8))
               for st in (2, 3, 4)]
    import time
    began = time.time()
    results = []
    for cfg in configs:
        if time.time() - began > args.seconds:
            print("  stopped: time", flush=True)
            break
        if cfg[5] and cfg[6] is False:
            continue
        try:
            use = lse2 if cfg[6] else lse
            col, win = run_nested(q, k, use, kpos, qpos, scale, 32, *cfg)
            err = float((col - ref_col).abs().max() / ref_col.abs().max())
            werr = float((win - ref_win).abs().max() / ref_win.abs().max())
            t = ms(lambda: run_nested(q, k, use, kpos, qpos, scale, 32, *cfg))
        except Exception as exc:  # noqa: BLE001
            print(f"  {cfg}: {type(exc).__name__} {str(exc)[:80]}", flush=True)
            continue
        results.append((t, cfg, err, werr))
        print(f"  {t:8.3f} ms  nested {cfg} rel err {err:.1e}/{werr:.1e}", flush=True)
    results.sort()
    print("best nested:")
    for t, cfg, err, werr in results[:8]:
        print(f"  {t:8.3f} ms  {cfg} err {err:.1e}/{werr:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--nested", action="store_true")
    args = parser.parse_args()
    if args.nested:
        return nested_main(args)
    n, hq, hkv, d = args.length, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = d ** -0.5
    ms = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    _, lse = causal_attention_lse(q, k, v, scale)
    lse = lse.float().contiguous()
    pos = torch.arange(n, device="cuda").view(1, n)
    key_pos = pos.view(1, 1, n).expand(1, hkv, n)
    valid = torch.ones(1, hkv, n, dtype=torch.bool, device="cuda")
    kpos, qpos = triton_attention._masked_positions(valid, key_pos, pos)
    t_attn = ms(lambda: causal_attention_lse(q, k, v, scale))
    ref_col, ref_win = triton_attention.column_sums_from_lse(q, k, lse, valid, key_pos, pos, scale, 32)
    t_cur = ms(lambda: triton_attention.column_sums_from_lse(q, k, lse, valid, key_pos, pos, scale, 32))
    flops = 2 * n * n * d * hq / 2
    print(f"{n} tokens: attention with lse {t_attn:.3f} ms; current column sums {t_cur:.3f} ms "
          f"({flops / t_cur / 1e9:.0f} TFLOP/s of QK^T)", flush=True)
    configs = []
    for prefetch, stages, heads, bm, bn, warps in itertools.product(
            (False, True), (3, 2), (1, 2, 4), (64, 128), (128, 256, 64), (4, 8)):
        rows = heads * bm
        if rows * bn > 128 * 256 * (warps // 4) or rows > 256:
            continue
        if prefetch and rows * bn * 2 > 128 * 256 * (warps // 4):
            continue
        configs.append((heads, bm, bn, warps, stages, prefetch, False))
    if args.quick:
        configs = configs[:4]
    results = []
    import time
    began = time.time()
    for cfg in configs:
        if time.time() - began > args.seconds:
            print(f"  stopped at {cfg}: time", flush=True)
            break
        try:
            col, win = run_variant(q, k, lse, kpos, qpos, scale, 32, *cfg)
            err = float((col - ref_col).abs().max() / ref_col.abs().max())
            werr = float((win - ref_win).abs().max() / ref_win.abs().max())
            t = ms(lambda: run_variant(q, k, lse, kpos, qpos, scale, 32, *cfg))
        except Exception as exc:  # noqa: BLE001 - scratch: a config that does not compile
            print(f"  {cfg}: {type(exc).__name__} {str(exc)[:80]}", flush=True)
            continue
        results.append((t, cfg, err, werr))
        print(f"  {t:8.3f} ms  heads {cfg[0]} bm {cfg[1]} bn {cfg[2]} warps {cfg[3]} stages {cfg[4]} "
              f"prefetch {cfg[5]}  rel err {err:.1e}/{werr:.1e}", flush=True)
    results.sort()
    print("best:")
    for t, cfg, err, werr in results[:8]:
        print(f"  {t:8.3f} ms  {cfg}  ({flops / t / 1e9:.0f} TFLOP/s) err {err:.1e}/{werr:.1e}")
    # the best with reversed launch order (longest key tiles last/first)
    for t, cfg, _, _ in results[:3]:
        rcfg = cfg[:-1] + (True,)
        tr = ms(lambda: run_variant(q, k, lse, kpos, qpos, scale, 32, *rcfg))
        print(f"  reversed {rcfg}: {tr:.3f} ms")


if __name__ == "__main__":
    main()
