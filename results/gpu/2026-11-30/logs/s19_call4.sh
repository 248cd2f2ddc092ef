# Nineteenth session, call 4 (carry [".whl"]): the first step's recording against the number of side lanes, one
# process, interleaved rounds (s19_lanes_ab.py).
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 400 python3 results/gpu/2026-11-30/logs/s19_lanes_ab.py --methods full,d2o,cam --lanes 32,4,2,1 --rounds 3 \
  --length 32768 > $OUT/lanes_ab.txt 2>&1; grep -vE "Warn|warn" $OUT/lanes_ab.txt | tail -14
