# s15 call 3: EMS's one-launch LUT attention (four item kinds, per-slot member references) on the GPU: CUDA tests,
# the kernel A/B against the five launches (same run), the 32k and 64k grids, full and EMS
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
echo "== tests $(date +%T)"
KVBENCH_KERNEL_TESTS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lut_attention.py \
  tests/kernels/test_ems_members_decode.py tests/kernels/test_methods_backends.py tests/test_cuda_decode.py \
  tests/test_golden_tokens.py -k "lut or ems or golden" > $OUT/tests.log 2>&1; echo "rc $?"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests.log | tail -8
echo "== bench $(date +%T)"
shapes=("1 6555 32768" "1 13108 65536" "32 3277 16384")
bench() { for shape in "${shapes[@]}"; do read rows slots context <<< "$shape"
  timeout 45 python3 -m scripts.bench_ems_kernels --rows $rows --slots $slots --context $context --only lut_attention "$@"; done; }
cp kvbench/kernels/triton_lut_attention.py /tmp/new_lut.py
bench --set lut.MEMBER_BLOCK=512,1024,2048 > $OUT/bench_new.log 2>&1
cp s15_old_lut.py kvbench/kernels/triton_lut_attention.py
bench > $OUT/bench_old.log 2>&1
cp /tmp/new_lut.py kvbench/kernels/triton_lut_attention.py
grep -E "^==|graph wall" $OUT/bench_new.log $OUT/bench_old.log
for L in 32768 65536; do echo "== grid $L $(date +%T)"
  timeout 150 python3 scripts/efficiency_grid.py --root /tmp/gpu/eff$L --models llama3.1-8b-shape-random \
    --methods full,ems --repeats 2 --warmup 1 --lengths $L --new-tokens 64 --limit-s 140 > $OUT/eff$L.log 2>&1
  python3 scripts/efficiency_targets.py --root /tmp/gpu/eff$L --profile gpu --out $OUT/eff$L.md > /dev/null 2>&1
  grep -E "ems|full" $OUT/eff$L.md
done
echo "== end $(date +%T)"
