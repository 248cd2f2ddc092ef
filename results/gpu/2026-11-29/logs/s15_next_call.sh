# The next session's first GPU call (one `run`, carry [".whl"], about 450 s), from the repository root at main.
# EMS's look-up-table attention, three ways timed inside one run (`bench_ems_kernels --only lut_attention`, graph
# replays, at 1 x 8 x 6,555 (32k), 1 x 8 x 13,108 (64k) and 32 x 8 x 3,277, and at 32k with half the table's
# members on one centre, a sink that gathers merges: both designs add member weights onto a centre atomically):
#   committed: five launches;
#   logs/s15_lut_last_program_combine.patch: the same with the output combined by the last weighted-values program;
#   logs/s15_lut_buckets.patch: members bucketed by their centre's tile (two launches over the table), then one
#     launch over key splits that reads each split's own members (three launches on the critical path).
# Then the bucket patch's CUDA tests and the 32k grid (full, EMS) with it.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
logs=results/gpu/2026-11-29/logs
shapes=("1 6555 32768 0" "1 13108 65536 0" "32 3277 16384 0" "1 6555 32768 0.5")  # rows slots context hot-share
bench() { for shape in "${shapes[@]}"; do read rows slots context hot <<< "$shape"; echo "== hot share $hot"
  timeout 45 python3 -m scripts.bench_ems_kernels --rows $rows --slots $slots --context $context --only lut_attention \
    --hot-share $hot; done; }
use() { git checkout -- kvbench/kernels/triton_lut_attention.py 2>/dev/null || cp /tmp/committed_lut.py kvbench/kernels/triton_lut_attention.py
  [ -z "$1" ] || git apply $1 || patch -p1 < $1; }
cp kvbench/kernels/triton_lut_attention.py /tmp/committed_lut.py
for variant in committed last_program_combine buckets; do echo "== bench, $variant $(date +%T)"
  if [ $variant = committed ]; then use; else use $logs/s15_lut_$variant.patch; fi
  bench > $OUT/bench_$variant.log 2>&1; grep -E "^==|graph wall" $OUT/bench_$variant.log
done
echo "== tests, buckets $(date +%T)"
KVBENCH_KERNEL_TESTS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lut_attention.py \
  tests/kernels/test_ems_members_decode.py tests/kernels/test_methods_backends.py tests/test_cuda_decode.py \
  -k "lut or ems" > $OUT/tests.log 2>&1; echo "rc $?"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests.log | tail -8
echo "== grid 32768, buckets $(date +%T)"
timeout 150 python3 scripts/efficiency_grid.py --root /tmp/gpu/eff32768 --models llama3.1-8b-shape-random \
  --methods full,ems --repeats 2 --warmup 1 --lengths 32768 --new-tokens 64 --limit-s 140 > $OUT/eff32768.log 2>&1
python3 scripts/efficiency_targets.py --root /tmp/gpu/eff32768 --profile gpu --out $OUT/eff32768.md > /dev/null 2>&1
grep -E "ems|full" $OUT/eff32768.md
# The second call: the CUDA suite's half that call 1 of the fifteenth session did not reach (at this code):
#   bash scripts/gpu_session.sh setup > /dev/null 2>&1; bash scripts/gpu_session.sh tests tests/tasks tests/test_*.py
