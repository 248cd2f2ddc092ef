# Twenty-third session, call 7 (carry [".whl"]): call 4's exact session, with the tiny models' fixtures shown.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
KVBENCH_KERNEL_TESTS=cuda timeout 260 python3 -m pytest -v -p no:cacheprovider --setup-show tests/kernels/test_decode_steps.py \
  tests/test_cuda_decode.py tests/test_decode_paths.py tests/test_golden_tokens.py tests/kernels/test_methods_backends.py \
  -k ems 2>&1 | grep -E "S tiny|FAILED|ERROR|passed|failed|test_method_identical|golden" | tee $OUT/s23_call7_order.txt | tail -30
