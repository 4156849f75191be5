#!/bin/bash
# The GPU checks in one run, for a machine with CUDA where raysync and its dependencies
# import (ray, nixl with its CUDA build, tensordict): the `gpu` tests, then bucketed and
# whole versions from a CUDA learner to two GPU receivers on `nixl`, `rdt` and
# `object_store` (benchmarks/buckets.py --device cuda). Each step is time-boxed so that
# a slow path shows up as a cut step, not a hung run. raysync must be installed, not only
# on PYTHONPATH: its actor classes (actors/, mapped to raysync.actors) are found through
# its entry points, so the script installs the checkout (editable, offline) where they
# are missing.
#
#   bash benchmarks/gpu_check.sh OUTDIR [BUDGET_S]  # gpu-tests.log, buckets_gpu_*.{json,png}
#
# BUDGET_S (default 540) bounds the whole run: each step's time box is cut to what is left,
# and a step with under 20 s left is skipped, so the logs come back within the budget.
set -o pipefail
out=${1:?usage: gpu_check.sh OUTDIR [BUDGET_S]}
budget=${2:-540}
mkdir -p "$out"
start=$(date +%s)
# box SECONDS: the step's own limit, or what is left of the budget if that is less.
box() {
  local left=$(( budget - ($(date +%s) - start) ))
  (( left < $1 )) && echo "$left" || echo "$1"
}
step_fits() { (( $(box 20) >= 20 )) || { echo "skipped: under 20 s of the budget left"; false; }; }
export PYTHONUNBUFFERED=1
python3 -c "import ray, nixl, tensordict, torch; print('ray', ray.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 1
python3 -c "import raysync.actors" 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout "$(box 200)" python3 -m pytest -m gpu -p no:cacheprovider -q -rA --timeout 90 \
  tests/test_nixl.py tests/test_buckets.py tests/test_distributed.py 2>&1 \
  | grep -v "WARNING authentication" > "$out/gpu-tests.log"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$out/gpu-tests.log" | tail -12
echo "tests done at $(( $(date +%s) - start )) s"
for transport in nixl rdt object_store; do
  step_fits || break
  timeout -k 5 "$(box 90)" python3 benchmarks/buckets.py --device cuda --transport "$transport" \
    --sizes 256 1024 --modes whole bucketed --receivers 2 --repeats 2 --timeout-s 60 \
    --progress --out "$out/buckets_gpu_$transport.json" 2>&1 | grep -E "MiB|broadcast|per bucket|Error"
  echo "$transport done at $(( $(date +%s) - start )) s"
done
# The broker's hand-off per bucket against the bucket size: 1 GiB in 4 buckets, not 16.
step_fits && timeout -k 5 "$(box 80)" python3 benchmarks/buckets.py --device cuda --transport nixl --sizes 1024 \
  --modes bucketed --bucket-mb 256 --receivers 2 --repeats 2 --timeout-s 60 --progress \
  --out "$out/buckets_gpu_nixl_256mb_buckets.json" 2>&1 | grep -E "MiB|broadcast|per bucket|Error"
echo "nixl, 256 MiB buckets, done at $(( $(date +%s) - start )) s"
