# The next session's GPU calls (carry [".whl"]), from the repository root at main. Nothing here was run.
#   bash results/gpu/2026-11-30/logs/s19_next_call.sh grid32   (about 450 s: all twelve methods at 32k)
#   bash results/gpu/2026-11-30/logs/s19_next_call.sh grid16   (about 200 s: 16k throughput, the tightest methods)
#   bash results/gpu/2026-11-30/logs/s19_next_call.sh grid64   (about 300 s: the decode-time methods at 64k)
# What they check: TPOT now runs from the first token (placing the row and recording the graph inside the first
# step, `dd4630d`), a batch's only row keeps its storage where it fits, else is copied once a tensor (`8d38da5`),
# D2O's prompt compression queues 131 operations a layer (`c96a5c1`), two side lanes (`eb26c9b`). Expected: D2O's 32k TPOT / full about 0.02 above this session's 1.01 and 0.92; at the 16k
# throughput batches the copy of one row into every slot lands in the first step (about 20 ms for CaM's 141 rows
# and the full cache's 29), so each bound fraction drops by about 3 %.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
grid() {  # name length methods limit [extra efficiency_grid arguments]
  timeout $4 python3 scripts/efficiency_grid.py --root /tmp/gpu/$1 --models llama3.1-8b-shape-random --methods $3 \
    --repeats 2 --warmup 1 --lengths $2 --limit-s 150 --deadline-s $(($4 - 30)) "${@:5}" > $OUT/$1.log 2>&1
  python3 scripts/efficiency_targets.py --root /tmp/gpu/$1 --profile gpu --out $OUT/$1.md > /dev/null 2>&1
  grep -E "TPOT|TTFT|bound|throughput" $OUT/$1.md
}
if [ "$1" = grid32 ]; then
  grid eff32 32768 full,d2o,ems,cam,weightedkv,h2o,tova,streamingllm,snapkv,pyramidkv,chelsea,kvmerger 560 \
    --new-tokens 64
elif [ "$1" = grid16 ]; then
  grid eff16 16384 full,cam,h2o,tova,weightedkv 280 --new-tokens 32 --override task.measure=throughput \
    --override task.batch_precision=0.1
elif [ "$1" = grid64 ]; then
  grid eff64 65536 full,ems,d2o,cam,weightedkv,h2o 560 --new-tokens 64
fi
