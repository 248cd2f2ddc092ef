# Nineteenth session, call 1 (carry [".whl"]): D2O's first step at 32k on one host/device timeline
# (s18_post_pass_probe.py, full and D2O and KVMerger), and the host cost of launching one layer's step kernels
# eagerly and under capture (s19_host_launch.py).
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
L=results/gpu/2026-11-30/logs
timeout 120 python3 $L/s19_host_launch.py > $OUT/host_launch.txt 2>&1
grep -vE "Warning|warn" $OUT/host_launch.txt | tail -8
timeout 300 python3 results/gpu/2026-11-29/logs/s18_post_pass_probe.py --methods full,d2o,kvmerger --length 32768 \
  --calls 2 > $OUT/post_pass.txt 2>&1
grep -vE "Warning|warn" $OUT/post_pass.txt | tail -40
