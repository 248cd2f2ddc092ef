# s16 call 6: the grids at 32k and 64k (full, EMS, D2O) with the vectorized LUT combine and the capture stream
# at high priority
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for len in 32768 65536; do echo "== grid $len $(date +%T)"
  timeout 200 python3 scripts/efficiency_grid.py --root /tmp/gpu/eff$len --models llama3.1-8b-shape-random \
    --methods full,ems,d2o --repeats 2 --warmup 1 --lengths $len --new-tokens 64 --limit-s 190 > $OUT/eff$len.log 2>&1
  python3 scripts/efficiency_targets.py --root /tmp/gpu/eff$len --profile gpu --out $OUT/eff$len.md > /dev/null 2>&1
  grep -E "ems|d2o|full" $OUT/eff$len.md; done
