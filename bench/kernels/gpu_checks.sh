#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# The DDTree core's kernel timings and GPU tests on a GPU host, one stage per
# call (each within about ten minutes on an H200):
#
#   bash bench/kernels/gpu_checks.sh STAGE
#
#   core      ddtree_core.py torch against triton (R = 1/8/64, B = 16/64/256,
#             V = 151936 and 8192), then the -m gpu core tests; torch + Triton
#             suffice (the installed vLLM's DDTree, else the checkout's overlay/)
#   corestep  the same with the runner's per-step kernels (our wheel installed)
#   kernels   the in-vLLM kernel tests on CUDA (tree attention, Gated DeltaNet
#             tree kernels, conv, state builder, runner checks)
#
# Environment: PYTHON (our wheel installed) [python3], OUT (JSON rows)
# [/tmp/ddtree-bench/out].
set -u
export PYTHONUNBUFFERED=1
case ${OUT:-} in ''|/*) ;; *) OUT=$PWD/$OUT ;; esac
cd "$(dirname "$0")/../.." || exit 2
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/ddtree-bench/out}
mkdir -p "$OUT"
STAGE=${1:-${STAGE:-}}
CORE=("$PYTHON" -m bench.kernels.ddtree_core --backend triton --iters 50)
case "$STAGE" in
core)
  nvidia-smi --query-gpu=name --format=csv,noheader
  for b in triton torch; do
    timeout 120 "${CORE[@]}" --backend $b --requests 1,8,64 \
      --budgets 16,64,256 --stages vocab,tree,core,full --out "$OUT/core_$b.json" 2>&1 | tail -11
  done
  timeout 40 "${CORE[@]}" --vocab 8192 --requests 1,32 --budgets 64,256 \
    --stages vocab,tree,core,full --out "$OUT/core_triton_v8k.json" 2>&1 | tail -5
  timeout 200 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rxXs \
    tests/unit/test_ddtree_core.py tests/unit/test_ddtree_vocab_threshold.py 2>&1 | tail -8 ;;
corestep)
  timeout 200 "${CORE[@]}" --requests 1,8,32 --budgets 16,64 \
    --stages vocab,tree,core,step --out "$OUT/core_step.json" 2>&1 | tail -8
  timeout 100 "${CORE[@]}" --vocab 8192 --requests 1,32 --budgets 64 \
    --stages vocab,tree,step --out "$OUT/core_step_v8k.json" 2>&1 | tail -4 ;;
kernels)
  (cd tests/in_vllm && timeout 400 "$PYTHON" -m pytest -q -p no:cacheprovider -c pytest.ini \
    test_tree_attention_split.py test_ddtree_gdn.py test_ddtree_gdn_builder.py \
    test_ddtree_gdn_hybrid.py test_ddtree_gdn_commit.py test_ddtree_hybrid_runner.py \
    test_ddtree_tree_conv.py test_ddtree_kernels.py test_ddtree_launch_counts.py \
    test_gdn_float32_prefill.py) 2>&1 | tail -5 ;;
*) echo "usage: bash bench/kernels/gpu_checks.sh core|corestep|kernels"; exit 2 ;;
esac
