# Twenty-third session, call 6 (carry [".whl"]): call 4's session again with the fixtures shown (SETUP/TEARDOWN of the
# tiny models), to find which earlier test leaves test_method_identical_with_torch_and_triton[ems] the CPU model.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
KVBENCH_KERNEL_TESTS=cuda timeout 200 python3 -m pytest -v -p no:cacheprovider --setup-show \
  tests/test_cuda_decode.py tests/test_decode_paths.py tests/kernels/test_methods_backends.py -k "ems" 2>&1 \
  | grep -E "S tiny|S cuda|PASSED|FAILED|ERROR|passed|failed|test_method_identical" | tee $OUT/s23_call6_order.txt | tail -40
