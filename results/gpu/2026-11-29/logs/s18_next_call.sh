# The next session's GPU calls (carry [".whl"]), from the repository root at main. Nothing here was run.
#   bash results/gpu/2026-11-29/logs/s18_next_call.sh postpass  (about 150 s: D2O's and KVMerger's first step at 32k,
#        the host and the device on one timeline from the budget read to the first replay: s18_post_pass_probe.py)
#   bash results/gpu/2026-11-29/logs/s17_next_call.sh grid32     (about 420 s: all twelve methods at 32k)
# postpass decides whether D2O's 32k first step (60-100 ms, against 6.0 ms at 64k) can hide under its prompt
# compressions: it can if the host queues them faster than the device runs them (today the host returns from
# prefill_row 0.4 ms after the device finished them, s18 call 3), e.g. through fewer torch operations a layer.
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ "$1" = postpass ]; then
  timeout 240 python3 results/gpu/2026-11-29/logs/s18_post_pass_probe.py --methods d2o,kvmerger --length 32768 \
    --calls 2 > $OUT/post_pass.txt 2>&1
  grep -vE "Warning|warn" $OUT/post_pass.txt | tail -24
fi
