# Twenty-first session, call 2 (carry [".whl"]; ab/old_triton_lut_attention.py travels untracked): call 1 again,
# the four launches now with float32 exp and log (float64 only where a tile leaves float32's range) after call 1
# found float64 transcendentals over whole tiles twice as slow: the CUDA tests, both paths' device time at 32k and
# 64k (one process), the 32k grid (full, EMS), the 64k grid (full, EMS).
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
KVBENCH_KERNEL_TESTS=cuda timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lut_attention.py \
  tests/kernels/test_ems_members_decode.py tests/kernels/test_attention_kernels.py -k "lut or members or decode" \
  > $OUT/s21_call2_tests.log 2>&1
echo "cuda tests rc=$?"; tail -3 $OUT/s21_call2_tests.log
p=results/gpu/2026-11-30/logs/s21_lut_ab.py
{ timeout 90 python3 $p --rows 1 --slots 6555 --context 32768 --tiles 64:4:3,128:8:3,64:8:3
  timeout 60 python3 $p --rows 1 --slots 13108 --context 65536; } 2>&1 | grep -v -i warn | tee $OUT/s21_call2_bench.txt
grid() {  # name length methods limit
  timeout $4 python3 scripts/efficiency_grid.py --root /tmp/gpu/$1 --models llama3.1-8b-shape-random --methods $3 \
    --repeats 2 --warmup 1 --lengths $2 --limit-s 150 --deadline-s $(($4 - 20)) --new-tokens 64 > $OUT/$1.log 2>&1
  python3 scripts/efficiency_targets.py --root /tmp/gpu/$1 --profile gpu --out $OUT/$1.md > /dev/null 2>&1
  grep -E "TPOT|TTFT" $OUT/$1.md
}
grid s21_call2_eff32 32768 full,ems 130
grid s21_call2_eff64 65536 full,ems 170
