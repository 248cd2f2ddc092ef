# Twenty-first session, call 3 (carry [".whl"]; ab/*_triton_lut_attention.py travel untracked): the four launches
# without a float64 transcendental or a branch on the tile's range (the member weights' power of two and log(1 + u)
# from the float64's bits) against call 2's (v1) and the committed five, one process; the CUDA tests of the kernels.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
p=results/gpu/2026-11-30/logs/s21_lut_ab.py
{ timeout 90 python3 $p --rows 1 --slots 6555 --context 32768 --v1 --tiles 128:8:3
  timeout 90 python3 $p --rows 1 --slots 13108 --context 65536 --v1
  timeout 90 python3 $p --rows 32 --slots 3277 --context 16384; } 2>&1 | grep -v -i warn | tee $OUT/s21_call3_bench.txt
KVBENCH_KERNEL_TESTS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lut_attention.py \
  tests/kernels/test_ems_members_decode.py > $OUT/s21_call3_tests.log 2>&1
echo "cuda tests rc=$?"; tail -3 $OUT/s21_call3_tests.log
