# call 3: D2O's and the full cache's recording host time with and without one memory pool for every capture
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for pool in "" --pool; do echo "== pool: ${pool:-none (committed)}"
  timeout 250 python3 results/gpu/2026-11-29/logs/s18_pool_probe.py $pool -- --methods full,d2o --length 32768 \
    --calls 2 > $OUT/pool${pool}.txt 2>&1
  grep -E "MemPool|call [0-9]: ttft|decode batch|Error" $OUT/pool${pool}.txt | cut -c1-260; done
