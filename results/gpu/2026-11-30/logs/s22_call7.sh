# Twenty-second session, call 7 (carry [".whl"]): the best-match search at 128 targets a step: its CUDA tests
# (similarity kernels, decode steps) and EMS's and D2O's 32k prompt compress (bench_prefill's layer).
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
KVBENCH_KERNEL_TESTS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_similarity_kernels.py \
  tests/kernels/test_decode_steps.py > $OUT/s22_call7_tests.log 2>&1
echo "cuda tests rc=$?"; tail -3 $OUT/s22_call7_tests.log
timeout 90 python3 scripts/bench_prefill.py --methods ems,d2o --lengths 32768 --repeats 3 --profile 2>&1 \
  | grep -v -i warn | tee $OUT/s22_call7_prefill.txt | grep -E "_best_match|^\|"
