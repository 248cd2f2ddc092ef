# Twenty-first session, call 4 (carry [".whl"]; ab/*_triton_lut_attention.py travel untracked): the four launches with
# the values' launch weighing each slot against its split's largest z (found in a first pass over the split's logits
# and member sums) instead of an online softmax, against v2 (call 3's) and the committed five, one process; the CUDA
# tests of the kernels; the 32k and 64k grids (full, EMS).
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
p=results/gpu/2026-11-30/logs/s21_lut_ab.py
{ timeout 80 python3 $p --rows 1 --slots 6555 --context 32768 --variants v2
  timeout 80 python3 $p --rows 1 --slots 13108 --context 65536 --variants v2
  timeout 80 python3 $p --rows 32 --slots 3277 --context 16384 --variants v2; } 2>&1 | grep -v -i warn \
  | tee $OUT/s21_call4_bench.txt
KVBENCH_KERNEL_TESTS=cuda timeout 80 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lut_attention.py \
  tests/kernels/test_ems_members_decode.py > $OUT/s21_call4_tests.log 2>&1
echo "cuda tests rc=$?"; tail -3 $OUT/s21_call4_tests.log
grid() {  # name length methods limit
  timeout $4 python3 scripts/efficiency_grid.py --root /tmp/gpu/$1 --models llama3.1-8b-shape-random --methods $3 \
    --repeats 2 --warmup 1 --lengths $2 --limit-s 150 --deadline-s $(($4 - 20)) --new-tokens 64 > $OUT/$1.log 2>&1
  python3 scripts/efficiency_targets.py --root /tmp/gpu/$1 --profile gpu --out $OUT/$1.md > /dev/null 2>&1
  grep -E "TPOT|TTFT" $OUT/$1.md
}
grid s21_call4_eff32 32768 full,ems 130
grid s21_call4_eff64 65536 full,ems 160
