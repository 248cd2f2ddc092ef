# call 4: the recording's pieces alone (fork, allocations, Triton launches under capture), then D2O's capture
# profiled with the lane fork's callees
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 120 python3 results/gpu/2026-11-29/logs/s18_capture_micro.py > $OUT/micro.txt 2>&1
tail -12 $OUT/micro.txt
timeout 200 python3 results/gpu/2026-11-29/logs/s17_capture_profile.py --methods d2o --length 32768 --top 60 \
  --callees "_observe_and_compress_in_pass|grad_mode.py:293|contextlib.py" \
  > $OUT/capture_profile.txt 2>&1; grep -E "== d2o" $OUT/capture_profile.txt
