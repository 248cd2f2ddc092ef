# Twenty-third session, call 1 (carry [".whl", "ab"]): EMS's look-up-table values launch (`_cluster_values`) with
# one barrier before its second loop instead of one a tile; ab/s23_ab.py swaps the committed kernel back in
# (ab.OLD_KERNEL=1) inside the same process. CUDA tests of the table attention; the call at three shapes against
# the kernel and decode.WAVES (the twenty-second session's 64k lead); EMS's replayed 64k and 32k steps, old and new.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
KVBENCH_KERNEL_TESTS=cuda timeout 110 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lut_attention.py \
  tests/kernels/test_ems_members_decode.py > $OUT/s23_call1_tests.log 2>&1
echo "cuda tests rc=$?"; tail -3 $OUT/s23_call1_tests.log
for shape in "1 13108 65536" "1 6555 32768" "32 3277 16384"; do set -- $shape
  timeout 80 python3 ab/s23_ab.py bench --only lut_attention --rows $1 --slots $2 --context $3 \
    --set ab.OLD_KERNEL=1,0 --set decode.WAVES=2,4
done 2>&1 | grep -v -i warn | tee $OUT/s23_call1_bench.txt | grep -E "^==|a call|_cluster_values"
for length in 65536 32768; do
  timeout 140 python3 ab/s23_ab.py steps --methods ems --length $length --rounds 3 --set ab.OLD_KERNEL=1,0
done 2>&1 | grep -v -i warn | tee $OUT/s23_call1_steps.txt
