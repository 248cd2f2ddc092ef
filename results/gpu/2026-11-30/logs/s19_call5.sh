# Nineteenth session, call 5 (carry [".whl"]): engine.LAYER_STREAMS 2 (was 32). The 16k throughput grid for the
# methods whose tokens/s ratio sits nearest its target (H2O 4.06, CaM 4.12, TOVA 4.16-4.20 at 32 lanes), then the
# 32k grid for full, D2O and CaM.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
grep -n "^LAYER_STREAMS" kvbench/engine.py
timeout 300 python3 scripts/efficiency_grid.py --root /tmp/gpu/eff16 --models llama3.1-8b-shape-random \
    --methods full,cam,h2o,tova,weightedkv --repeats 2 --warmup 1 --lengths 16384 --new-tokens 32 \
    --override task.measure=throughput --override task.batch_precision=0.1 --limit-s 120 --deadline-s 280 \
    > $OUT/eff16.log 2>&1
python3 scripts/efficiency_targets.py --root /tmp/gpu/eff16 --profile gpu --out $OUT/eff16.md > /dev/null 2>&1
grep -E "throughput|batch|tokens|bound" $OUT/eff16.md | head -20
timeout 250 python3 scripts/efficiency_grid.py --root /tmp/gpu/eff32 --models llama3.1-8b-shape-random \
    --methods full,d2o,cam --repeats 2 --warmup 1 --lengths 32768 --new-tokens 64 --limit-s 150 --deadline-s 230 \
    > $OUT/eff32.log 2>&1
python3 scripts/efficiency_targets.py --root /tmp/gpu/eff32 --profile gpu --out $OUT/eff32.md > /dev/null 2>&1
grep -E "TPOT|TTFT" $OUT/eff32.md
