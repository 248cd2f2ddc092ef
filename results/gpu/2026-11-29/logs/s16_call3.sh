# s16 call 3: the capture stream at high priority (new) against default priority (old), replayed steps at 32k
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1
bash $s ab s16_old scripts/profile_decode.py --methods full,ems,d2o,cam,weightedkv --length 32768 --modes graphs \
  --top 12 > $OUT/ab_priority_32k.txt 2>&1
grep -E "^== (old|new)|^ +(full|ems|d2o|cam|weightedkv) +graphs|timeline" $OUT/ab_priority_32k.txt
