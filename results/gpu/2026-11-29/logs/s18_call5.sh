# call 5: replayed 32k steps of the full cache and three lane-using methods with the driver's default 8 hardware
# work queues against 32 (CUDA_DEVICE_MAX_CONNECTIONS, read at context creation): do the 32 side lanes share 8 queues
# with the step's own stream, so that a lane's launch waits behind another stream's work?
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for conn in 8 32; do echo "== CUDA_DEVICE_MAX_CONNECTIONS=$conn"
  CUDA_DEVICE_MAX_CONNECTIONS=$conn timeout 200 python3 scripts/profile_decode.py --methods full,ems,d2o,cam \
    --length 32768 --modes graphs --top 3 > $OUT/connections_$conn.txt 2>&1
  grep -E "graphs: |timeline|Error" $OUT/connections_$conn.txt; done
