#!/usr/bin/env bash
# What ran on the GPU machine, from the repository root, with wheels of hydra-core 1.3.8, omegaconf 2.3.1 and
# antlr4-python3-runtime 4.9.3 in .whl/ (the image has torch, triton, transformers, pandas, pyarrow, ...):
#   s=results/gpu/2026-11-22/gpu_session.sh
#   bash $s setup; bash $s tests; bash $s probe; bash $s bench   # first call
#   bash $s setup; bash $s grid --models M --methods A,B --lengths 16384,32768 --repeats 3 ...; bash $s pack
# Every step appends to $OUT/session.log; `pack` tars /tmp/gpu (all outputs) into $OUT/gpu.tar.gz.
set -u
step=$1
shift
here=results/gpu/2026-11-22
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
tests)  # compiled Triton (TRITON_INTERPRET unset) against the torch references, on the GPU
  KVBENCH_KERNEL_TESTS=cuda timeout 280 python3 -m pytest -q tests/kernels -p no:cacheprovider -m "slow or not slow" -rs \
    --junitxml=$work/kernel_tests.xml > $work/kernel_tests.log 2>&1
  echo "kernel tests rc=$?"; grep -E "FAILED|passed|failed|Error" $work/kernel_tests.log ;;
probe)  # which methods are feasible at 16k (one timing, no warm-up; the times are not reported)
  timeout 300 python3 $here/run_efficiency.py --root $work/probe --models llama3.1-8b-shape-random \
    --methods streamingllm,snapkv,h2o,chelsea,kvmerger,d2o,ems,weightedkv --lengths 16384 --repeats 1 --warmup 0 \
    --new-tokens 8 --limit-s 60 --deadline-s 280 2>&1 | grep -E "GRID|Error" ;;
bench)
  timeout 150 python3 -m kvbench.bench kernels --device cuda --head-dim 128 --repeats 5 --max-seconds 2 --out $work/bench \
    2>&1 | tail -40 ;;
grid)   # run_efficiency.py arguments follow
  python3 $here/run_efficiency.py --root $work/eff "$@" 2>&1 | grep -E "GRID|Error" ;;
pack)
  tar czf $OUT/gpu.tar.gz -C /tmp gpu; ls -la $OUT ;;
*)
  echo "unknown step '$step'; accepted: setup, tests, probe, bench, grid, pack"; exit 2 ;;
esac
