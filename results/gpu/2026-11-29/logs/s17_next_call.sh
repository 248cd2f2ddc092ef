# The next session's GPU calls (carry [".whl"]), from the repository root at main. Nothing here was run.
#   bash results/gpu/2026-11-29/logs/s17_next_call.sh grid32   (about 450 s: all twelve methods at 32k)
#   bash results/gpu/2026-11-29/logs/s17_next_call.sh grid64   (about 300 s: the decode-time methods at 64k)
#   bash results/gpu/2026-11-29/logs/s17_next_call.sh probe    (about 150 s: D2O's first step, probe and grid)
#   bash results/gpu/2026-11-29/logs/s17_green_lanes.sh       (about 300 s: EMS's lanes on fewer multiprocessors)
# The targets tables now say, beside each TPOT ratio, the ratio after the first decode step (first_step_seconds,
# tpot_after_first_seconds: `6caf419`). That separates a decode batch's graph recording, a one-off cost that
# lands on the first step, from every step's cost, for every method in one grid.
# probe: the seventh session's first-step probe said D2O's 32k TPOT / full is 1.16 where the grid said 1.02-1.06,
# same code and machine (s17 calls 4 and 6); the grid's rows now carry the first step, so one call shows whether
# the grid's first step is shorter than the probe's or its other steps are.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
grid() {  # name length methods limit
  timeout $4 python3 scripts/efficiency_grid.py --root /tmp/gpu/$1 --models llama3.1-8b-shape-random --methods $3 \
    --repeats 2 --warmup 1 --lengths $2 --new-tokens 64 --limit-s 150 --deadline-s $(($4 - 60)) > $OUT/$1.log 2>&1
  python3 scripts/efficiency_targets.py --root /tmp/gpu/$1 --profile gpu --out $OUT/$1.md > /dev/null 2>&1
  grep -E "TPOT|bound" $OUT/$1.md
}
if [ "$1" = grid32 ]; then
  grid eff32 32768 full,d2o,ems,cam,weightedkv,h2o,tova,streamingllm,snapkv,pyramidkv,chelsea,kvmerger 560
elif [ "$1" = grid64 ]; then
  grid eff64 65536 full,ems,d2o,cam,weightedkv,h2o 560
elif [ "$1" = probe ]; then
  timeout 200 python3 results/gpu/2026-11-28/logs/s7_first_step_probe.py --methods full,d2o --length 32768 \
    --calls 2 > $OUT/probe.txt 2>&1
  grep -E "call [01]: ttft|decode batch" $OUT/probe.txt | cut -c1-200
  grid effd2o 32768 full,d2o 200
  python3 - <<'PY'
import glob, pandas as pd
for path in sorted(glob.glob("/tmp/gpu/effd2o/runs/*/predictions.parquet")):
    df = pd.read_parquet(path)
    ends = ("system", "ttft_seconds", "tpot_seconds", "first_step_seconds", "tpot_after_first_seconds")
    print(path); print(df[[c for c in df.columns if c.endswith(ends)]].to_string())
PY
fi
