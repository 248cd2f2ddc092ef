# Twenty-third session, call 3 (carry [".whl"]): the 16k throughput grid for the two methods that miss it (D2O, EMS)
# beside the full cache, at 91b79c0 (EMS's last measurement there was 2026-11-28, before its step was rewritten).
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 470 python3 scripts/efficiency_grid.py --root /tmp/gpu/eff16 --models llama3.1-8b-shape-random \
    --methods full,d2o,ems --repeats 2 --warmup 1 --lengths 16384 --new-tokens 32 \
    --override task.measure=throughput --override task.batch_precision=0.1 --limit-s 150 --deadline-s 450 \
    > $OUT/s23_call3_eff16.log 2>&1
python3 scripts/efficiency_targets.py --root /tmp/gpu/eff16 --profile gpu --out $OUT/s23_call3_eff16.md > /dev/null 2>&1
grep -E "throughput|batch|tokens|bound" $OUT/s23_call3_eff16.md | head -20
