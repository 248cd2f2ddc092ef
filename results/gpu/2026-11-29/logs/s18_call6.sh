# call 6: the decode-time methods at 64k, with the first-step split (s17_next_call.sh grid64), keeping every run's
# predictions.parquet under its run directory's name
bash results/gpu/2026-11-29/logs/s17_next_call.sh grid64
for d in /tmp/gpu/eff64/runs/*/; do cp $d/predictions.parquet $OUT/$(basename $d).parquet 2>/dev/null; \
  cp $d/.hydra/overrides.yaml $OUT/$(basename $d).overrides.yaml 2>/dev/null; done; ls $OUT | head -30
