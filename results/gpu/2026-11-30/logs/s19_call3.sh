# Nineteenth session, call 3 (carry [".whl"]): s19_gap_probe.py for D2O at 32k, profiled (call 2's probe stopped at
# a double profiler start), with the lanes as committed (32), with one lane (evictions in line after the pass),
# and with expandable segments.
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
L=results/gpu/2026-11-30/logs
timeout 170 python3 $L/s19_gap_probe.py --methods d2o --length 32768 --top 45 > $OUT/gap_d2o.txt 2>&1
grep -E "^==|^   during" $OUT/gap_d2o.txt
timeout 140 python3 $L/s19_gap_probe.py --methods d2o --length 32768 --lanes 1 > $OUT/gap_d2o_lanes1.txt 2>&1
grep -E "^==|^   during" $OUT/gap_d2o_lanes1.txt
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 140 python3 $L/s19_gap_probe.py --methods d2o,full \
  --length 32768 > $OUT/gap_expandable.txt 2>&1
grep -E "^==|^   during" $OUT/gap_expandable.txt
