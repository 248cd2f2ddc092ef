# Nineteenth session, call 6 (carry [".whl"]): engine.LAYER_STREAMS 2. The 32k grid for the other methods that fork
# side lanes (EMS, H2O, WeightedKV, TOVA, StreamingLLM) with full and D2O again, then the 64k grid for full, D2O
# and EMS.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
grid() {  # name length methods limit
  timeout $4 python3 scripts/efficiency_grid.py --root /tmp/gpu/$1 --models llama3.1-8b-shape-random --methods $3 \
    --repeats 2 --warmup 1 --lengths $2 --new-tokens 64 --limit-s 150 --deadline-s $(($4 - 30)) > $OUT/$1.log 2>&1
  python3 scripts/efficiency_targets.py --root /tmp/gpu/$1 --profile gpu --out $OUT/$1.md > /dev/null 2>&1
  grep -E "TPOT|bound" $OUT/$1.md
}
grid eff32b 32768 full,d2o,ems,h2o,weightedkv,tova,streamingllm 280
grid eff64 65536 full,d2o,ems 230
