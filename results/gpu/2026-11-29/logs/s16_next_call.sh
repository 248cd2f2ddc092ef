# The next session's first GPU calls (carry [".whl"]), from the repository root at main.
#   bash results/gpu/2026-11-29/logs/s16_next_call.sh bench   (about 450 s)
#   bash results/gpu/2026-11-29/logs/s16_next_call.sh grid    (about 300 s; with the patch applied if it won)
#   bash results/gpu/2026-11-29/logs/s16_next_call.sh host    (about 120 s)
#   bash results/gpu/2026-11-29/logs/s16_next_call.sh branch  (about 90 s)
# bench: EMS's look-up-table attention as committed (five launches) against logs/s16_lut_member_gather.patch (a
# split-K pass over the slots, one over the table's members with their centres' value rows gathered, and
# triton_decode's combine: three launches), at 1 x 8 x 6,555 (32k), 1 x 8 x 13,108 (64k), 32 x 8 x 3,277 and 32k
# with half the members on one centre; then the patch's member-pass tiles and waves at 32k and 32 rows, and the
# patch's CUDA LUT/EMS tests. grid: the issue's 32k and 64k grids, full and EMS. host: where an eager decode step's
# host time goes for the full cache and D2O at 32k (a capture's recording runs the same Python): D2O's 50-55 ms
# recording runs on an idle device and costs its 32k TPOT ratio about 0.12 over 64 tokens.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
patch_file=results/gpu/2026-11-29/logs/s16_lut_member_gather.patch
apply() { git apply $patch_file 2>/dev/null || patch -p1 < $patch_file; }
if [ "$1" = bench ]; then
  shapes=("1 6555 32768 0" "1 13108 65536 0" "32 3277 16384 0" "1 6555 32768 0.5")  # rows slots context hot-share
  bench() { for shape in "${shapes[@]}"; do read rows slots context hot <<< "$shape"; echo "== hot share $hot"
    timeout ${limit:-45} python3 -m scripts.bench_ems_kernels --rows $rows --slots $slots --context $context \
      --only lut_attention --hot-share $hot "$@"; done; }
  echo "== bench, committed $(date +%T)"; bench > $OUT/bench_committed.log 2>&1
  grep -E "graph wall" $OUT/bench_committed.log
  apply; echo "== bench, member gather $(date +%T)"; bench > $OUT/bench_member_gather.log 2>&1
  grep -E "graph wall" $OUT/bench_member_gather.log
  shapes=("1 6555 32768 0" "32 3277 16384 0"); echo "== member pass tiles and waves $(date +%T)"
  limit=200 bench --set lut.MEMBER_TILES=64:4:1,128:4:1,128:4:2,128:4:3,128:8:2 --set lut.MEMBER_WAVES=1,4,8 \
    > $OUT/bench_member_sweep.log 2>&1
  grep -E "^== [0-9]|graph wall" $OUT/bench_member_sweep.log
  echo "== tests, member gather $(date +%T)"
  KVBENCH_KERNEL_TESTS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lut_attention.py \
    tests/kernels/test_ems_members_decode.py tests/kernels/test_methods_backends.py tests/test_cuda_decode.py \
    -k "lut or ems" > $OUT/tests.log 2>&1; echo "rc $?"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests.log | tail -8
elif [ "$1" = grid ]; then
  [ "$2" = committed ] || apply
  for len in 32768 65536; do echo "== grid $len $(date +%T)"
    timeout 200 python3 scripts/efficiency_grid.py --root /tmp/gpu/eff$len --models llama3.1-8b-shape-random \
      --methods full,ems --repeats 2 --warmup 1 --lengths $len --new-tokens 64 --limit-s 190 > $OUT/eff$len.log 2>&1
    python3 scripts/efficiency_targets.py --root /tmp/gpu/eff$len --profile gpu --out $OUT/eff$len.md > /dev/null 2>&1
    grep -E "ems|full" $OUT/eff$len.md; done
elif [ "$1" = host ]; then
  timeout 200 python3 -m scripts.profile_host --methods full,d2o --length 32768 --steps 10 --top 30 > $OUT/host.txt 2>&1
  grep -E "^==|function calls" $OUT/host.txt
elif [ "$1" = branch ]; then  # the full cache's replayed step with trivial side branches (logs/s16_branch_probe.py)
  timeout 200 python3 results/gpu/2026-11-29/logs/s16_branch_probe.py --length 32768 --lanes 32 > $OUT/branch.txt 2>&1
  grep -E "^==|timeline|gap" $OUT/branch.txt
fi
