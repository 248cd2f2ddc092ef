# Twenty-third session, call 5 (carry [".whl", "ab"]): call 4's one failure (test_method_identical_with_torch_and_triton[ems]
# ran on the CPU model) depends on the order of the session: the same test after a top-level test, with the fixtures
# shown, then before it; then the values launch at 32 rows, old and new interleaved twice.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for order in "tests/test_golden_tokens.py tests/kernels/test_methods_backends.py" \
             "tests/kernels/test_methods_backends.py tests/test_golden_tokens.py"; do
  echo "== $order"
  KVBENCH_KERNEL_TESTS=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider --setup-show $order -k "ems and not stop" \
    2>&1 | grep -E "SETUP +S tiny|passed|failed|ERROR|FAILED"
done 2>&1 | tee $OUT/s23_call5_order.txt
python3 -c "import pytest; print('pytest', pytest.__version__)"
timeout 90 python3 ab/s23_ab.py bench --only lut_attention --rows 32 --slots 3277 --context 16384 \
  --set ab.OLD_KERNEL=1,0,1,0 2>&1 | grep -v -i warn | tee $OUT/s23_call5_bench32.txt | grep -E "^==|a call|_cluster_values"
