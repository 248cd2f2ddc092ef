# Nineteenth session, call 2 (carry [".whl"]): what D2O's first step at 32k is made of on the host
# (s19_gap_probe.py: host marks from the last compression to the capture, the allocator's segments during the
# capture, cProfile of the gap and of the recording), full and D2O; then D2O with expandable segments.
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
L=results/gpu/2026-11-30/logs
timeout 260 python3 $L/s19_gap_probe.py --methods full,d2o --length 32768 > $OUT/gap.txt 2>&1
grep -E "^==|^   during" $OUT/gap.txt
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 200 python3 $L/s19_gap_probe.py --methods d2o \
  --length 32768 > $OUT/gap_expandable.txt 2>&1
grep -E "^==|^   during" $OUT/gap_expandable.txt
