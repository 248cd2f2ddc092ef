# s17 call 4: D2O's layer-budget statistics read right after the last layer's attention (new) against after the
# whole pass (old, s17_old = git archive 622b7f1 kvbench conf): the first decode step's host marks at 32k (the
# seventh session's probe), the CUDA D2O decode tests, then the 32k grid, full and D2O, new code
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONUNBUFFERED=1
bash $s ab s17_old results/gpu/2026-11-28/logs/s7_first_step_probe.py --methods full,d2o --length 32768 --calls 2 \
  > $OUT/probe_ab.txt 2>&1
grep -E "^== (old|new)|call [0-9]: ttft" $OUT/probe_ab.txt | grep -v "sync debug" | cut -c1-230
export PYTHONPATH=/tmp/site:$PWD
KVBENCH_KERNEL_TESTS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_decode.py \
  tests/methods/test_d2o.py -k "d2o or D2O" > $OUT/tests.log 2>&1; echo "tests rc $?"; tail -3 $OUT/tests.log
timeout 220 python3 scripts/efficiency_grid.py --root /tmp/gpu/eff --models llama3.1-8b-shape-random \
  --methods full,d2o \
  --repeats 2 --warmup 1 --lengths 32768 --new-tokens 64 --limit-s 200 > $OUT/grid32k.log 2>&1
python3 scripts/efficiency_targets.py --root /tmp/gpu/eff --profile gpu --out $OUT/targets_32k.md > /dev/null 2>&1
cat $OUT/targets_32k.md
