"""A/B (not committed): a decode batch's capture through kvbench's side-stream capture vs torch.cuda.graph."""
import logging, sys, tempfile, contextlib
from pathlib import Path
import torch
from omegaconf import OmegaConf
from kvbench import runner, graphs
from kvbench.memory import release_memory
from scripts.bench_sweep import points, decode_batches

logging.basicConfig(level=logging.WARNING)
ours = graphs.DecodeGraph._capture

def torch_graph_capture(self, decisions):
    before = [[layer.host_lengths.copy() for layer in s.cache.layers] for s in self.sessions]
    torch.cuda.synchronize()
    self.graph = torch.cuda.CUDAGraph()
    import time
    t = time.perf_counter()
    with torch.cuda.graph(self.graph):
        self.body(True)
    self.capture_host["recording"] += time.perf_counter() - t
    # the rest as ours after recording
    self.delta, self.bytes_delta = [], []
    for session, lengths in zip(self.sessions, before):
        deltas = [layer.host_lengths - b for layer, b in zip(session.cache.layers, lengths)]
        self.delta.append([int(d.flat[0]) for d in deltas])
        self.bytes_delta.append(sum(int(d.flat[0]) * d.shape[1] * layer.kv.slot_bytes for d, layer in zip(deltas, session.cache.layers)))
    self.ordered = [[layer.ordered for layer in s.cache.layers] for s in self.sessions]
    self.logits = [s.logits for s in self.sessions]
    self.captured = decisions
    self.graph.replay()
    self.safe = self._safe_replays()

over = ["model=llama3.1-8b-shape-random", "task=niah", "task.context_lengths=[16000]", "task.depths=[0,14,29,43,57,71,86,100]", "batch_size=8", "method=full,streamingllm,h2o", "budget=0.2"]
with tempfile.TemporaryDirectory() as tmp:
    cfgs = points(over, Path(tmp) / "a")
    with contextlib.redirect_stdout(sys.stderr):
        for cfg in cfgs:
            runner.run(OmegaConf.merge(cfg, {"results_root": str(Path(tmp) / "w")}))
            release_memory()
        for rep in range(2):
            for mode, fn in (("side-stream", ours), ("torch.cuda.graph", torch_graph_capture), ("eager-first", ours)):
                graphs.DecodeGraph._capture = fn
                for i, cfg in enumerate(cfgs):
                    if mode == "eager-first":
                        graphs.WARMED.clear()
                    with decode_batches() as b:
                        runner.run(OmegaConf.merge(cfg, {"results_root": str(Path(tmp) / f"{mode}{rep}")}))
                    release_memory()
                    print(mode, rep, runner.method_name(cfg), b.lines[-1].split("(", 1)[1], flush=True)
