# The next session's first GPU call (one `run`, under 600 s; carry [".whl"]), from the repository root after
#   git apply results/gpu/2026-11-29/logs/s12_key_probe_d2o_v3.patch
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
L=results/gpu/2026-11-29/logs
echo "== tests $(date +%T)"  # the probe's cosines must be the match kernel's bits on the GPU too
KVBENCH_KERNEL_TESTS=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_steps.py \
    tests/kernels/test_methods_backends.py -k "d2o" > $OUT/tests.log 2>&1; echo "rc $?"; tail -1 $OUT/tests.log
echo "== bench $(date +%T)"
timeout 120 python3 $L/s12_probe_bench.py 1:13108:65536 104:3277:16384 > $OUT/probe_bench.log 2>&1
grep -E "^==|attention|_kernel" $OUT/probe_bench.log
echo "== waves $(date +%T)"  # more, shorter splits at batch one: D2O's attention and EMS's LUT launches
timeout 60 python3 $L/s12_probe_bench.py --waves 2,4,8 1:6555:32768 1:13108:65536 > $OUT/waves.log 2>&1
for slots in 6555 13108; do
  timeout 60 python3 -m scripts.bench_ems_kernels --rows 1 --slots $slots --context $((slots * 5)) \
      --only lut_attention --set decode.WAVES=2,4,8
done >> $OUT/waves.log 2>&1; grep -E "^==|attention:" $OUT/waves.log
echo "== grid $(date +%T)"  # only if the bench shows the probe paying at 104 rows (else stop here)
timeout 200 python3 scripts/efficiency_grid.py --root /tmp/gpu/eff16 --models llama3.1-8b-shape-random \
    --methods full,d2o --repeats 2 --warmup 1 --lengths 16384 --new-tokens 32 --override task.measure=throughput \
    --override task.batch_precision=0.1 --limit-s 190 > $OUT/eff16.log 2>&1
python3 scripts/efficiency_targets.py --root /tmp/gpu/eff16 --profile gpu --out $OUT/eff16.md > /dev/null 2>&1
grep d2o $OUT/eff16.md
echo "== end $(date +%T)"
