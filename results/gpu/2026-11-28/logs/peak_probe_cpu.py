"""Peak tensor bytes above the weights during engine.generate (D2O, CaM, H2O) and plain model.generate, CPU,
allocator reports through the public profiler (independent of the kvbench version on PYTHONPATH)."""
import sys, torch
from torch.profiler import profile, ProfilerActivity
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from kvbench import models
from kvbench.__main__ import CONF_DIR
from kvbench.budget import Budget
from kvbench.engine import Engine

def peak(fn):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    running = best = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        running += e.nbytes(); best = max(best, running)
    return best

def cfg(method, model):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        c = compose(config_name="config", overrides=[f"model={model}", f"method={method}"])
    return c.model, instantiate(c.method)

import contextlib, kvbench.engine as E
class _NoPeak:
    def __init__(self, *a, **k): self.bytes = 0
    def __enter__(self): return self
    def __exit__(self, *a): return False
if hasattr(E, "PeakMemory"):
    E.PeakMemory = _NoPeak
model_name, length = sys.argv[1], int(sys.argv[2])
lm = models.load(cfg("full", model_name)[0])
prompt = torch.randint(3, len(lm.tokenizer), (length,), generator=torch.Generator().manual_seed(0)).tolist()
ids = torch.tensor([prompt])
bare = peak(lambda: lm.model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids)))
out = [f"bare {bare/1e6:.1f} MB"]
for name in sys.argv[3].split(","):
    engine = Engine(lm.model, cfg(name, model_name)[1], Budget("fraction", 0.2))
    engine.generate([prompt], 4, stop_token_ids=set(), min_new_tokens=4)  # warm
    p = peak(lambda: engine.generate([prompt], 4, stop_token_ids=set(), min_new_tokens=4))
    out.append(f"{name} {p/1e6:.1f} MB ({p/bare:.2f} of bare)")
print(" | ".join(out))
