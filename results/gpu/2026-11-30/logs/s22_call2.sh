# Twenty-second session, call 2 (carry [".whl"]): where EMS's replayed 32k step goes now (full and EMS, graphs +
# compile, the kernel pairs around the most idle time), and the look-up-table attention's splits and tiles with
# launch 2's 256-entry blocks (call 1's best), at 32k, 64k and 32 rows x 3,277 slots.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 260 python3 scripts/profile_decode.py --methods full,ems --length 32768 --modes graphs+compile --gaps 12 \
  --top 30 2>&1 | grep -v -i warn | tee $OUT/s22_call2_profile_32k.txt
for shape in "1 6555 32768" "1 13108 65536"; do set -- $shape
  timeout 90 python3 -m scripts.bench_ems_kernels --only lut_attention --rows $1 --slots $2 --context $3 \
    --set lut.MEMBER_BLOCK=256 --set decode.WAVES=2,4 --set lut.LUT_TILES=128:4:3,64:4:3
done 2>&1 | grep -v -i warn | tee $OUT/s22_call2_lut_splits.txt
timeout 90 python3 -m scripts.bench_ems_kernels --only lut_attention --rows 32 --slots 3277 --context 16384 \
  --set lut.MEMBER_BLOCK=256,1024 2>&1 | grep -v -i warn | tee $OUT/s22_call2_lut_rows32.txt
