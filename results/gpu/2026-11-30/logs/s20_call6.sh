# Call 6 (carry [".whl"]), at the commit that folds EMS's centre map into lut_attention's launches: the CUDA tests of
# the changed kernels and paths, the 32k grid (full, EMS), both paths' device time (one process), the 64k grid.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
KVBENCH_KERNEL_TESTS=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lut_attention.py \
  tests/kernels/test_ems_members_decode.py tests/kernels/test_lut_expand.py > $OUT/s20_call6_tests.log 2>&1
echo "cuda tests rc=$?"; tail -3 $OUT/s20_call6_tests.log
grid() {  # name length methods limit
  timeout $4 python3 scripts/efficiency_grid.py --root /tmp/gpu/$1 --models llama3.1-8b-shape-random --methods $3 \
    --repeats 2 --warmup 1 --lengths $2 --limit-s 150 --deadline-s $(($4 - 20)) --new-tokens 64 > $OUT/$1.log 2>&1
  python3 scripts/efficiency_targets.py --root /tmp/gpu/$1 --profile gpu --out $OUT/$1.md > /dev/null 2>&1
  grep -E "TPOT|TTFT" $OUT/$1.md
}
grid s20_call6_eff32 32768 full,ems 120
p=results/gpu/2026-11-30/logs/s20_csr_lut_probe.py
{ python3 $p --engine-paths --rows 1 --slots 6555 --context 32768
  python3 $p --engine-paths --rows 1 --slots 13108 --context 65536; } 2>&1 | grep -v -i warn | tee $OUT/s20_call6_bench.txt
grid s20_call6_eff64 65536 full,ems 150
