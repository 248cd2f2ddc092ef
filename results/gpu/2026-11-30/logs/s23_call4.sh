# Twenty-third session, call 4 (carry [".whl"]): every CUDA test that names EMS (decode steps, CUDA decode and its
# graphs, decode paths, golden tokens, torch against Triton) at 91b79c0, the values launch's single barrier.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
KVBENCH_KERNEL_TESTS=cuda timeout 400 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_decode_steps.py \
  tests/test_cuda_decode.py tests/test_decode_paths.py tests/test_golden_tokens.py tests/kernels/test_methods_backends.py \
  -k ems > $OUT/s23_call4_tests.log 2>&1
echo "cuda tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" $OUT/s23_call4_tests.log | tail -15
