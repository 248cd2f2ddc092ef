# EMS's and the full cache's replayed 32k steps with the side lanes on green-context streams of 16, 32 and 66
# multiprocessors, against the committed lanes (0), one process each (logs/s17_green_lanes.py); about 300 s
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for sms in 0 32 16 66; do echo "== side lanes on $sms multiprocessors (0: all, as committed)"
  timeout 140 python3 results/gpu/2026-11-29/logs/s17_green_lanes.py --sms $sms -- --methods full,ems \
    --length 32768 --modes graphs --top 6 > $OUT/green_$sms.txt 2>&1
  grep -E "green|graphs: |_redundancy|Error|error" $OUT/green_$sms.txt | head -8; done
