# Twenty-second session, call 5 (carry [".whl"]): where H2O's and EMS's 32k peaks lie (s22_peak_probe.py).
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 300 python3 results/gpu/2026-11-30/logs/s22_peak_probe.py --methods h2o,ems,full --length 32768 --top 22 \
  2>&1 | grep -v -i warn | tee $OUT/s22_call5_peaks.txt
