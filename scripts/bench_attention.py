"""One layer's attention work at a real shape, each way kvbench can do it (GPU): medians of CUDA-event timings.

    python scripts/bench_attention.py --length 32768 --heads 32 --kv-heads 8 --head-dim 128

Prefill: the wrapped sdpa (what the full cache runs), the lse-returning forwards (FlashAttention's, cuDNN's),
the column-sum pass from the lse at several tile shapes, and the window-only statistics. Chunked prefill: the
whole prompt as ``--chunk``-token chunks through ``chunk_attention`` (each chunk over the cached slots and its
own), summed, against the unchunked causal pass and FlashAttention's bottom-right causal op over the same
dense chunks. Decode: sdpa over a dense cache against the split-K kernel over static-capacity storage, at the
full and at a 0.2 cache.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

from kvbench.kernels import triton_attention, triton_chunk, triton_decode
from kvbench.kernels.chunk_attention import chunk_attention
from kvbench.kernels.column_sums import causal_attention_lse
from kvbench.kernels.triton_decode import decode_attention


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=4096)
    args = parser.parse_args()
    n, hq, hkv, d = args.length, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = d ** -0.5
    rep = hq // hkv
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    rows = [("sdpa causal, enable_gqa", ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                               scale=scale, enable_gqa=True))),
            ("sdpa causal, repeated kv", ms(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True,
                                                                                scale=scale))),
            ("causal_attention_lse: cuDNN with lse over the GQA heads",
             ms(lambda: causal_attention_lse(q, k, v, scale)))]
    try:
        rows.append(("cudnn op with lse (repeated kv)", ms(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, kr, vr, None, True, 0.0, True, False, scale=scale))))
    except RuntimeError as err:
        rows.append((f"cudnn op with lse: {str(err)[:60]}", float("nan")))
    _, lse = causal_attention_lse(q, k, v, scale)
    pos = torch.arange(n, device="cuda").view(1, n)
    key_pos = pos.view(1, 1, n).expand(1, hkv, n)
    valid = torch.ones(1, hkv, n, dtype=torch.bool, device="cuda")
    for tiles in [(64, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 8, 3), (128, 64, 4, 3),
                  (128, 64, 8, 3), (64, 64, 4, 3)]:
        triton_attention.COLUMN_SUMS_TILES = tiles
        rows.append((f"column sums tiles {tiles}", ms(lambda: triton_attention.column_sums_from_lse(
            q, k, lse, valid, key_pos, pos, scale))))
    w = args.window
    rows.append(("window stats: lse of last window (Triton) + sums", ms(lambda: triton_attention.column_sums_from_lse(
        q[:, :, -w:], k, triton_attention.attention_lse(q[:, :, -w:], k, None, valid, key_pos, pos[:, -w:], scale)[1],
        valid, key_pos, pos[:, -w:], scale, window=w))))
    c = args.chunk
    stops = range(c, n + 1, c)
    stores = [(torch.full((1, hkv), stop, device="cuda"), q[:, :, stop - c:stop]) for stop in stops]
    chosen = triton_chunk.TILES
    for tiles in [chosen, (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 2)]:
        triton_chunk.TILES = tiles
        rows.append((f"chunked prefill: {len(stores)} chunks of {c}, chunk_attention tiles {tiles}, sum", ms(
            lambda: [chunk_attention(qc, k, v, lengths, scale) for lengths, qc in stores])))
    triton_chunk.TILES = chosen
    rows.append((f"chunked prefill: {len(stores)} chunks of {c}, flash op bottom-right causal, sum", ms(lambda: [
        torch.ops.aten._scaled_dot_product_flash_attention(q[:, :, stop - c:stop], kr[:, :, :stop], vr[:, :, :stop],
                                                           0.0, True, False, scale=scale) for stop in stops])))
    flops = 4 * n * n * d * hq / 2
    for cache in (n, n // 5):
        kc, vc = k[:, :, :cache].contiguous(), v[:, :, :cache].contiguous()
        qd = q[:, :, -1:].contiguous()
        lengths = torch.full((1, hkv), cache, device="cuda")
        rows.append((f"decode sdpa dense, {cache} slots", ms(lambda: F.scaled_dot_product_attention(
            qd, kc, vc, scale=scale, enable_gqa=True))))
        store_k = torch.zeros(1, hkv, cache + 64, d, device="cuda", dtype=torch.bfloat16)
        store_v = torch.zeros_like(store_k)
        store_k[:, :, :cache], store_v[:, :, :cache] = kc, vc
        rows.append((f"decode split-K over capacity, {cache} slots", ms(lambda: decode_attention(
            qd, store_k, store_v, lengths, None, None, scale, cache + 64))))
        rows.append((f"decode split-K + step attention, {cache} slots", ms(lambda: decode_attention(
            qd, store_k, store_v, lengths, None, None, scale, cache + 64, want_step=True))))
    # the split-K kernel's tiles (slots, warps, stages) and waves: the bytes-read time of K+V is the target
    kv_bytes = 2 * n * hkv * d * 2
    store_k, store_v = (torch.cat([t, t.new_zeros(1, hkv, 64, d)], dim=2) for t in (k, v))
    qd, lengths = q[:, :, -1:].contiguous(), torch.full((1, hkv), n, device="cuda")
    chosen = triton_decode.DECODE_TILES, triton_decode.WAVES
    for tiles in [(64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3), (32, 4, 4)]:
        for waves in (2, 4):
            triton_decode.DECODE_TILES, triton_decode.WAVES = tiles, waves
            triton_decode._programs_wanted.cache_clear()
            t = ms(lambda: decode_attention(qd, store_k, store_v, lengths, None, None, scale, n + 64))
            rows.append((f"decode split-K tiles {tiles}, {waves} waves, {n} slots: {kv_bytes / t / 1e6:.0f} GB/s", t))
    triton_decode.DECODE_TILES, triton_decode.WAVES = chosen
    triton_decode._programs_wanted.cache_clear()
    print(f"one layer, {n} tokens, {hq} query / {hkv} kv heads, head dim {d}, bf16 "
          f"(causal attention = {flops / 1e12:.2f} TFLOP)")
    for name, t in rows:
        print(f"  {t:9.3f} ms  {name}")


if __name__ == "__main__":
    main()
