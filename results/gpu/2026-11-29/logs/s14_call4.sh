s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export KVBENCH_KERNEL_TESTS=cuda
echo "== d2o tests $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_steps.py tests/kernels/test_methods_backends.py -k "d2o" > $OUT/d2o.log 2>&1
echo "rc $?"; grep -E "^FAILED|passed|failed" $OUT/d2o.log
echo "== bench $(date +%T)"
timeout 60 python3 -m scripts.bench_ems_kernels --rows 104 --slots 3277 --context 16384 --only d2o_step \
  > $OUT/bench.log 2>&1; grep -E "^==|_kernel|call" $OUT/bench.log
echo "== end $(date +%T)"
