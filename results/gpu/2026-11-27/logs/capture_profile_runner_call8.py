"""(not committed) cProfile of a timed run's direct capture at batch 8, in the runner's context."""
import cProfile, io, logging, pstats, sys, tempfile, contextlib
from pathlib import Path
from omegaconf import OmegaConf
from kvbench import runner, graphs
from kvbench.memory import release_memory
from scripts.bench_sweep import points

logging.basicConfig(level=logging.WARNING)
ours = graphs.DecodeGraph._capture
prof = cProfile.Profile()
def profiled(self, decisions):
    prof.enable()
    try:
        return ours(self, decisions)
    finally:
        prof.disable()

over = ["model=llama3.1-8b-shape-random", "task=niah", "task.context_lengths=[16000]", "task.depths=[0,14,29,43,57,71,86,100]", "batch_size=8", "method=streamingllm", "budget=0.2"]
with tempfile.TemporaryDirectory() as tmp:
    [cfg] = points(over, Path(tmp) / "a")
    with contextlib.redirect_stdout(sys.stderr):
        runner.run(OmegaConf.merge(cfg, {"results_root": str(Path(tmp) / "w")}))
        release_memory()
        graphs.DecodeGraph._capture = profiled
        for rep in range(2):
            runner.run(OmegaConf.merge(cfg, {"results_root": str(Path(tmp) / f"t{rep}")}))
            release_memory()
for key in ("tottime", "cumulative"):
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(key).print_stats(40)
    print("== by", key)
    print("\n".join(l[:170] for l in out.getvalue().splitlines() if l.strip()))
