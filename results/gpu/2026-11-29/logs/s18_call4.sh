# call 4: the recording's pieces alone (fork, allocations, Triton launches under capture), then D2O's capture
# profiled with the lane fork's callees
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 120 python3 results/gpu/2026-11-29/logs/s18_capture_micro.py > $OUT/micro.txt 2>&1; cat $OUT/micro.txt | tail -12
timeout 200 python3 results/gpu/2026-11-29/logs/s18_capture_profile.py --methods d2o --length 32768 --top 60 \
  > $OUT/capture_profile.txt 2>&1; grep -E "== d2o" $OUT/capture_profile.txt
