#!/usr/bin/env bash
# The steps a GPU session runs, from the repository root, on a machine whose image has torch, triton,
# transformers, pandas, pyarrow (see results/gpu/*/README.md), with wheels of hydra-core, omegaconf and
# antlr4-python3-runtime in .whl/:
#   s=scripts/gpu_session.sh
#   bash $s setup; bash $s tests; bash $s steps; bash $s grid --models M --methods A,B --lengths 32768 ...; bash $s pack
# Every step appends to $OUT/session.log; `pack` tars /tmp/gpu (all outputs) into $OUT/gpu.tar.gz.
set -u
step=$1
shift
work=/tmp/gpu
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
mkdir -p $work
exec > >(tee -a $OUT/session.log) 2>&1
echo "== $step $* ($(date -u +%T))"

case $step in
setup)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import sys,torch,triton,transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
    python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)"; } > $work/env.txt 2>&1
  cat $work/env.txt ;;
tests)  # compiled kernels against the torch references, CUDA graphs against eager steps, no sync in a step
  KVBENCH_KERNEL_TESTS=cuda timeout 300 python3 -m pytest -q tests/kernels -p no:cacheprovider -m "slow or not slow" \
    --ignore=tests/kernels/test_decode_steps.py -rs --junitxml=$work/kernel_tests.xml > $work/kernel_tests.log 2>&1
  echo "kernel tests rc=$?"; grep -E "FAILED|passed|failed|Error" $work/kernel_tests.log
  # the fused decode steps apart: ~100 compiled variants (flags x dtypes x head dims)
  KVBENCH_KERNEL_TESTS=cuda timeout 400 python3 -m pytest -q tests/kernels/test_decode_steps.py -p no:cacheprovider \
    -m "slow or not slow" -rs --junitxml=$work/decode_steps.xml > $work/decode_steps.log 2>&1
  echo "decode step tests rc=$?"; grep -E "FAILED|passed|failed|Error" $work/decode_steps.log
  timeout 300 python3 -m pytest -q tests/test_cuda_decode.py -p no:cacheprovider -rs \
    --junitxml=$work/cuda_decode.xml > $work/cuda_decode.log 2>&1
  echo "cuda decode tests rc=$?"; grep -E "FAILED|passed|failed|Error" $work/cuda_decode.log ;;
bench)  # kernel timings, torch vs Triton
  timeout 150 python3 -m kvbench.bench kernels --device cuda --head-dim 128 --repeats 5 --max-seconds 2 --out $work/bench \
    2>&1 | tail -40 ;;
steps)  # the merging methods' decode step of one layer (Llama-3.1-8B shape: 8 KV heads, d 128), graph-replayed
  for batch in 1 64; do
    timeout 240 python3 -m kvbench.bench kernels --device cuda --ops cam_step,d2o_step,weightedkv_step,ems_step \
      --lengths 3277,6554 --batch $batch --kv-heads 8 --head-dim 128 --repeats 5 --out $work/steps_b$batch \
      2>&1 | tail -24
  done ;;
grid)   # scripts/efficiency_grid.py arguments follow (--root defaults to $work/eff)
  python3 scripts/efficiency_grid.py --root $work/eff "$@" 2>&1 | grep -E "GRID|Error" ;;
targets)
  python3 scripts/efficiency_targets.py --root $work/eff --profile gpu --out $work/targets.md ;;
pack)
  tar czf $OUT/gpu.tar.gz -C /tmp gpu; ls -la $OUT ;;
*)
  echo "unknown step '$step'; accepted: setup, tests, bench, steps, grid, targets, pack"; exit 2 ;;
esac
