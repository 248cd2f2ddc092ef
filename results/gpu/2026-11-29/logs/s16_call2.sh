# s16 call 2: the LUT combine with all splits in one tile against the committed loop over splits (A/B twice, one run),
# the CUDA LUT/EMS tests with it, then where EMS's and the full cache's replayed steps go at 32k
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
shapes=("1 6555 32768 0" "1 13108 65536 0" "32 3277 16384 0")  # rows slots context hot-share
bench() { for shape in "${shapes[@]}"; do read rows slots context hot <<< "$shape"; echo "== hot share $hot"
  timeout 45 python3 -m scripts.bench_ems_kernels --rows $rows --slots $slots --context $context --only lut_attention \
    --hot-share $hot; done; }
for v in committed new committed new; do echo "== bench, $v $(date +%T)"; cp s16_${v}_lut.py kvbench/kernels/triton_lut_attention.py
  bench >> $OUT/bench_$v.log 2>&1; grep -E "graph wall|_combine" $OUT/bench_$v.log | tail -6; done
echo "== tests $(date +%T)"
KVBENCH_KERNEL_TESTS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lut_attention.py \
  tests/kernels/test_ems_members_decode.py tests/kernels/test_methods_backends.py tests/test_cuda_decode.py \
  -k "lut or ems" > $OUT/tests.log 2>&1; echo "rc $?"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests.log | tail -8
echo "== profile $(date +%T)"
timeout 240 python3 scripts/profile_decode.py --methods full,ems --length 32768 --modes graphs --top 40 \
  > $OUT/profile_32k.txt 2>&1; echo "rc $?"; tail -5 $OUT/profile_32k.txt
