"""Token for token (calls 39, 40): EMS, H2O and StreamingLLM (budget 0.2, CUDA graphs) decode the same four 16k
random prompts, 32 new tokens, batch 4, with the code of `3dd2314` (before this session's decode-step changes; a
copy of its ``kvbench`` and ``conf`` under ``old_3dd2314/``) and with the code now, each in a process of its own,
with the Triton kernels and (``--reference``, call 40) also with the torch references (``KVBENCH_KERNELS=torch``);
the predictions of every pair are compared.

    PYTHONPATH=/tmp/site python3 results/gpu/2026-11-27/logs/old_vs_new_tokens_call39.py [--reference]
"""
import json
import os
import subprocess
import sys
from pathlib import Path

METHODS = ("ems", "h2o", "streamingllm")


def run() -> None:
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import kvbench
    from kvbench import models
    from kvbench.budget import Budget
    from kvbench.engine import Engine

    conf = str(Path(kvbench.__file__).resolve().parent.parent / "conf")
    out = {}
    lm = None
    for name in METHODS:
        with initialize_config_dir(config_dir=conf, version_base="1.3"):
            cfg = compose(config_name="config", overrides=["model=llama3.1-8b-shape-random", f"method={name}"])
        lm = lm or models.load(cfg.model)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, len(lm.tokenizer), (16000 - 37 * i,), generator=g).tolist() for i in range(4)]
        engine = Engine(lm.model, instantiate(cfg.method), Budget("fraction", 0.2), cuda_graphs=True)
        out[name] = [gen.tokens for gen in engine.generate(prompts, 32, stop_token_ids=set(), batch_size=4)]
    print("TOKENS " + json.dumps(out))


def decoded(label: str, command: list[str], env: dict, cwd: Path) -> dict:
    """The tokens a child process decoding with ``command`` prints (its ``TOKENS`` line); exits, with the child's
    error, when it printed none."""
    done = subprocess.run([sys.executable, *command], env=env, cwd=cwd, capture_output=True, text=True)
    line = [l for l in done.stdout.splitlines() if l.startswith("TOKENS ")]
    if not line:
        print(label, "failed:", done.stderr[-3000:])
        sys.exit(1)
    return json.loads(line[0][7:])


if __name__ == "__main__":
    if sys.argv[1:] == ["run"]:
        run()
        sys.exit()
    here = Path.cwd()
    site = os.environ.get("PYTHONPATH", "")
    runs = [("old", here / "old_3dd2314", "auto"), ("new", here, "auto")]
    if "--reference" in sys.argv:
        runs += [("old torch", here / "old_3dd2314", "torch"), ("new torch", here, "torch")]
    got = {}
    for label, root, kernels in runs:
        env = dict(os.environ, PYTHONPATH=f"{root}:{site}", KVBENCH_KERNELS=kernels)
        got[label] = decoded(label, [__file__, "run"], env, root)
    labels = list(got)
    for name in METHODS:
        for i, a in enumerate(labels):
            for b in labels[i + 1:]:
                x, y = got[a][name], got[b][name]
                same = sum(p == q for p, q in zip(x, y))
                first = [next((k for k, (s, t) in enumerate(zip(p, q)) if s != t), None) for p, q in zip(x, y)]
                print(f"{name}: {a} vs {b}: identical predictions {same} / {len(x)}; first differing token: {first}")
