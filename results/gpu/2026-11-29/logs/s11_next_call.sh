# The next session's first GPU call (one `run`, under 600 s; carry [".whl"]), from the repository root after
#   git apply results/gpu/2026-11-29/logs/s11_key_probe_d2o_v2.patch
# Every output goes to $OUT; the summary lines to stdout.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
echo "== tests $(date +%T)"
KVBENCH_KERNEL_TESTS=cuda timeout 110 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_steps.py \
    tests/test_cuda_decode.py -k "d2o and not compile" > $OUT/tests.log 2>&1; echo "rc $?"; tail -1 $OUT/tests.log
echo "== kernels $(date +%T)"
for shape in "--rows 104 --slots 3277 --context 16384" "--rows 1 --slots 13108 --context 65536"; do
  timeout 60 python3 -m scripts.bench_ems_kernels $shape --only d2o_step 2>&1 | grep -E "^==|d2o_step:|_kernel"
done > $OUT/d2o_kernels.log; cat $OUT/d2o_kernels.log
timeout 60 python3 -m scripts.bench_ems_kernels --rows 1 --slots 13108 --context 65536 --only lut_attention \
    --set lut.LUT_TILES=64:4:3,128:4:3,64:8:3 > $OUT/lut_tiles.log 2>&1; grep -E "^==|lut_attention:" $OUT/lut_tiles.log
grid() {  # name, PROBE_MIN_ROWS, grid arguments
  local name=$1 rows=$2; shift 2
  timeout 130 python3 -c "import runpy, sys, kvbench.attention as a; a.PROBE_MIN_ROWS = $rows; sys.argv = ['g'] + sys.argv[1:]; runpy.run_path('scripts/efficiency_grid.py', run_name='__main__')" \
      --root /tmp/gpu/$name --models llama3.1-8b-shape-random --methods full,d2o --repeats 2 --warmup 1 "$@" \
      --limit-s 120 > $OUT/$name.log 2>&1
  python3 scripts/efficiency_targets.py --root /tmp/gpu/$name --profile gpu --out $OUT/$name.md > /dev/null 2>&1
  echo "$name: $(grep d2o $OUT/$name.md | cut -d'|' -f2,6 | tr '\n' ' ')"
}
echo "== grids $(date +%T)"
grid eff64_probe 0 --lengths 65536 --new-tokens 64
grid eff64_plain 1000000000 --lengths 65536 --new-tokens 64
grid eff16_probe 0 --lengths 16384 --new-tokens 32 --override task.measure=throughput --override task.batch_precision=0.1
echo "== end $(date +%T)"
