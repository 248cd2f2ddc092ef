# The next session's first GPU call (carry [".whl"]), from the repository root at main: the 64k grid after d43023b
# (EMS's centre map inside lut_attention's launches), whose EMS run the twentieth session's last call ran out of
# device time for (s20_call6.sh), and EMS's 32k run again beside the full cache. About 300 s.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
grid() {  # name length methods limit
  timeout $4 python3 scripts/efficiency_grid.py --root /tmp/gpu/$1 --models llama3.1-8b-shape-random --methods $3 \
    --repeats 2 --warmup 1 --lengths $2 --limit-s 150 --deadline-s $(($4 - 20)) --new-tokens 64 > $OUT/$1.log 2>&1
  python3 scripts/efficiency_targets.py --root /tmp/gpu/$1 --profile gpu --out $OUT/$1.md > /dev/null 2>&1
  grep -E "TPOT|TTFT" $OUT/$1.md
}
grid eff64 65536 full,ems,d2o 330
grid eff32 32768 full,ems 150
