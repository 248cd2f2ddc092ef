# s14 call 5: golden tokens on the GPU host's CPU with and without AVX2 kernels forced; the similarity kernels'
# CUDA tests after the torch best_match_cosine change; a second 64k grid of full and D2O
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch; print('cpu capability', torch.backends.cpu.get_cpu_capability())"; grep -m1 "model name" /proc/cpuinfo
echo "== golden, as the host dispatches $(date +%T)"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_golden_tokens.py 2>&1 | grep -E "^FAILED|passed|failed"
echo "== golden, ATEN_CPU_CAPABILITY=avx2 $(date +%T)"
ATEN_CPU_CAPABILITY=avx2 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_golden_tokens.py 2>&1 | grep -E "^FAILED|passed|failed"
echo "== golden, + MKL_ENABLE_INSTRUCTIONS=AVX2 $(date +%T)"
ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_golden_tokens.py 2>&1 | grep -E "^FAILED|passed|failed"
echo "== similarity CUDA tests $(date +%T)"
KVBENCH_KERNEL_TESTS=cuda timeout 80 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_similarity_kernels.py 2>&1 | grep -E "^FAILED|passed|failed"
echo "== grid64 $(date +%T)"
timeout 170 python3 scripts/efficiency_grid.py --root /tmp/gpu/eff64 --models llama3.1-8b-shape-random \
    --methods full,d2o --repeats 2 --warmup 1 --lengths 65536 --new-tokens 64 --limit-s 160 > $OUT/eff64.log 2>&1
python3 scripts/efficiency_targets.py --root /tmp/gpu/eff64 --profile gpu --out $OUT/eff64.md > /dev/null 2>&1
grep -E "d2o" $OUT/eff64.md
python3 - <<'PY'
import pandas as pd, pathlib
m = pd.concat([pd.read_parquet(p) for p in pathlib.Path("/tmp/gpu/eff64/runs").glob("*/metrics.parquet")])
print(m.loc[m["metric"].str.contains("tpot|ttft", regex=True), ["method", "metric", "value"]].to_string(max_rows=40))
PY
echo "== end $(date +%T)"
