# Twenty-second session, call 4 (carry [".whl"]): launch 2's entries a program chosen by its programs
# (MEMBER_BLOCKS / MEMBER_PROGRAMS_PER_SM: 256 at one row, 1,024 at 32 rows x 3,277 slots): the CUDA tests of the
# look-up-table attention and EMS's decode; the kernel's call at the three shapes; the 32k and 64k grids (full, EMS).
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
KVBENCH_KERNEL_TESTS=cuda timeout 110 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lut_attention.py \
  tests/kernels/test_ems_members_decode.py > $OUT/s22_call4_tests.log 2>&1
echo "cuda tests rc=$?"; tail -3 $OUT/s22_call4_tests.log
for shape in "1 6555 32768" "1 13108 65536" "32 3277 16384"; do set -- $shape
  timeout 60 python3 -m scripts.bench_ems_kernels --only lut_attention --rows $1 --slots $2 --context $3
done 2>&1 | grep -v -i warn | tee $OUT/s22_call4_bench.txt | grep -E "^==|a call"
bash $s targets s22_call4_eff32 32768 full,ems 130
bash $s targets s22_call4_eff64 65536 full,ems 160
