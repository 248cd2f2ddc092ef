import torch, triton.testing
n, hq, hkv, d = 32768, 32, 8, 128
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
v = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
s = d ** -0.5
kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
ms = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
ref = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kr, vr, None, True, 0.0, True, False, scale=s)
for name, fn in [("cudnn gqa native", lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=s)),
                 ("flash gqa native", lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=s))]:
    try:
        out = fn()
        print(name, "out diff", float((out[0].float() - ref[0].float()).abs().max()), "lse diff",
              float((out[1].reshape(ref[1].shape).float() - ref[1].float()).abs().max()), f"{ms(fn):.3f} ms", flush=True)
    except Exception as e:
        print(name, "failed:", str(e)[:200], flush=True)
print(f"repeated cudnn {ms(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, kr, vr, None, True, 0.0, True, False, scale=s)):.3f} ms")
