"""s14: why D2O's streamed best match differs from the tiled one on the H200 in bf16: capture both launches' block
results (similarity, position, slot) and print where they differ, with torch's float64 cosines of the candidates."""
import torch
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
from kvbench.kernels import triton_d2o_step
from tests.kernels.test_decode_steps import storage

captured = {}
real_merge = triton_d2o_step._merge_kernel


class Capture:
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            captured["blocks"] = [a.clone() for a in args[9:12]]
            captured["victim"] = [a.clone() for a in args[6:9]]
            return real_merge[grid](*args, **kwargs)
        return launch


triton_d2o_step._merge_kernel = Capture()
for dtype in (torch.bfloat16, torch.float32):
    for ties in (False, True):
        results = {}
        for min_span in (0, 2**62):
            triton_d2o_step.STREAMED_MIN_SPAN = min_span
            s = {k: v.to(DEVICE) for k, v in storage(3, 2, 700, 16, 3, dtype, 5).items()}
            s["state"][2] = 0.3
            if ties:
                s["keys"][..., 1::3, :] = 0
                s["keys"][..., 1::3, 0] = 2.0
                s["state"][1, ..., 1::3] = 0
            keys0 = s["keys"].clone()
            triton_d2o_step.d2o_step(s["keys"], s["values"], s["positions"], s["lengths"], s["state"], s["state"][1],
                                     s["state"][2], s["n_keep"], 3, 1, 2, 0.7, False, True)
            results[min_span] = (dict(captured), s, keys0)
        (a, sa, k0), (b, sb, _) = results[0], results[2**62]
        print(f"== {dtype} ties={ties}")
        # best per row over blocks
        for name, x, y in zip(("sim", "pos", "slot"), a["blocks"], b["blocks"]):
            print(name, "shapes", tuple(x.shape), tuple(y.shape))
        simA, posA, slotA = a["blocks"]
        simB, posB, slotB = b["blocks"]
        for r in range(simA.shape[0]):
            ia, ib = simA[r].argmax(), simB[r].argmax()
            ha, hb = simA[r].max(), simB[r].max()
            # the best block results: a's best may sit in another block than b's
            sa_slot = slotA[r][simA[r] == ha].min().item(); sb_slot = slotB[r][simB[r] == hb].min().item()
            if ha.item() != hb.item() or sa_slot != sb_slot:
                print(f"row {r}: streamed {ha.item()!r} slot {sa_slot}; tiled {hb.item()!r} slot {sb_slot}")
                print("   streamed blocks", simA[r].tolist(), slotA[r].tolist())
                print("   tiled blocks", simB[r].tolist(), slotB[r].tolist())
                vic = a["victim"][2].view(simA.shape[0], -1)
                print("   victim slots (per block)", vic[r].tolist())
        diff = (sa["state"] != sb["state"]) & ~(sa["state"].isnan() & sb["state"].isnan())
        print("state differs at", diff.nonzero().tolist()[:10])
        for idx in diff.nonzero().tolist()[:4]:
            print("  ", idx, sa["state"][tuple(idx)].item(), sb["state"][tuple(idx)].item())
