# The next session's first GPU call (one `run`, under 600 s; carry [".whl"]), from the repository root at main.
# 1. CUDA D2O tests: the streamed best match (STREAMED_TILE (32, 4)) gives the tiled kernel's bits on the GPU, and
#    the step attention made in d2o_step's first launch gives the two launches' bits;
# 2. D2O's observation + step at batch one (64k) and at 104 rows (16k batch): two launches against one;
# 3. the 64k grid (full, d2o: the TPOT target, 0.853 before) and the 16k throughput grid, with unrounded metrics.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
echo "== tests $(date +%T)"
KVBENCH_KERNEL_TESTS=cuda timeout 110 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_steps.py \
    tests/kernels/test_methods_backends.py -k "d2o" > $OUT/tests.log 2>&1; echo "rc $?"; tail -1 $OUT/tests.log
echo "== bench $(date +%T)"
for shape in "1 13108 65536" "104 3277 16384"; do set -- $shape
  timeout 40 python3 -m scripts.bench_ems_kernels --rows $1 --slots $2 --context $3 --only d2o_observe_step
done > $OUT/bench.log 2>&1; grep -E "^==|_kernel|step attention" $OUT/bench.log
echo "== grid64 $(date +%T)"
timeout 150 python3 scripts/efficiency_grid.py --root /tmp/gpu/eff64 --models llama3.1-8b-shape-random \
    --methods full,d2o --repeats 2 --warmup 1 --lengths 65536 --new-tokens 64 --limit-s 140 > $OUT/eff64.log 2>&1
python3 scripts/efficiency_targets.py --root /tmp/gpu/eff64 --profile gpu --out $OUT/eff64.md > /dev/null 2>&1
grep d2o $OUT/eff64.md
echo "== grid16 $(date +%T)"
timeout 170 python3 scripts/efficiency_grid.py --root /tmp/gpu/eff16 --models llama3.1-8b-shape-random \
    --methods full,d2o --repeats 2 --warmup 1 --lengths 16384 --new-tokens 32 --override task.measure=throughput \
    --override task.batch_precision=0.1 --limit-s 160 > $OUT/eff16.log 2>&1
python3 scripts/efficiency_targets.py --root /tmp/gpu/eff16 --profile gpu --out $OUT/eff16.md > /dev/null 2>&1
grep d2o $OUT/eff16.md
python3 - <<'PY'
import pandas as pd, pathlib
frames = [pd.read_parquet(p) for p in pathlib.Path("/tmp/gpu/eff16/runs").glob("*/metrics.parquet")]
m = pd.concat(frames)
wanted = m["metric"].str.contains("tokens_per_second|bound_fraction|batch", regex=True)
print(m.loc[wanted, ["method", "metric", "value"]].to_string(max_rows=60))
PY
echo "== end $(date +%T)"
