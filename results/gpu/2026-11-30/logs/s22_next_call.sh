# Prepared for the next session (carry [".whl"]; about 300 s): the look-up-table attention's splits and tiles, which
# call 2 found 11 % faster at 64k with 64-slot tiles and decode.WAVES=4 (74.9 -> 66.6 us) and unchanged at 32k:
# the call at the three shapes, then EMS's replayed 64k and 32k steps over the same settings (one process a length,
# interleaved rounds). A setting that wins at 64k without losing at 32k or 32 rows becomes a rule by program count,
# as launch 2's entries did.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for shape in "1 13108 65536" "1 6555 32768" "32 3277 16384"; do set -- $shape
  timeout 90 python3 -m scripts.bench_ems_kernels --only lut_attention --rows $1 --slots $2 --context $3 \
    --set lut.LUT_TILES=128:4:3,64:4:3 --set decode.WAVES=2,4
done 2>&1 | grep -v -i warn | tee $OUT/s23_lut_splits.txt | grep -E "^==|a call"
for length in 65536 32768; do
  timeout 150 python3 results/gpu/2026-11-30/logs/s22_step_knobs.py --methods ems --length $length --rounds 3 \
    --set lut.LUT_TILES=128:4:3,64:4:3 --set decode.WAVES=2,4
done 2>&1 | grep -v -i warn | tee $OUT/s23_step_splits.txt
