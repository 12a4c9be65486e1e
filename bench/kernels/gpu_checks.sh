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
#   corevocab TREES=DIR: ddtree_core.py for each variant DIR/<name>/vllm/...
#             (SRCS="base vocab": their names, '+' or ' ' between them;
#             CORE_STAGES: its stages), then the GPU core and vocabulary-pass
#             tests (CORE_TESTS=0: not)
#   kernels   the in-vLLM kernel tests on CUDA (tree attention, Gated DeltaNet
#             tree kernels, conv, state builder, runner checks)
#
# Environment: PYTHON (our wheel installed) [python3], OUT (JSON rows)
# [/tmp/ddtree-bench/out], SRC (core, corestep: a directory whose
# vllm/v1/spec_decode/ddtree/ files replace the imported ones) [unset].
set -u
export PYTHONUNBUFFERED=1
abspath() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
for v in OUT TREES SRC; do
  [ -n "${!v:-}" ] && export "$v=$(abspath "${!v}")"
done
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
    timeout 120 "${CORE[@]}" ${SRC:+--src "$SRC"} --backend $b --requests 1,8,64 \
      --budgets 16,64,256 --stages vocab,tree,core,full --out "$OUT/core_$b.json" 2>&1 | tail -11
  done
  timeout 40 "${CORE[@]}" ${SRC:+--src "$SRC"} --vocab 8192 --requests 1,32 --budgets 64,256 \
    --stages vocab,tree,core,full --out "$OUT/core_triton_v8k.json" 2>&1 | tail -5
  timeout 100 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rxXs tests/test_ddtree_core.py 2>&1 | tail -8 ;;
corestep)
  timeout 200 "${CORE[@]}" ${SRC:+--src "$SRC"} --requests 1,8,32 --budgets 16,64 \
    --stages vocab,tree,core,step --out "$OUT/core_step.json" 2>&1 | tail -8
  timeout 100 "${CORE[@]}" ${SRC:+--src "$SRC"} --vocab 8192 --requests 1,32 --budgets 64 \
    --stages vocab,tree,step --out "$OUT/core_step_v8k.json" 2>&1 | tail -4 ;;
corevocab)
  T=${TREES:?set TREES to a directory with one tree per name in SRCS}
  SRCS=${SRCS:-base vocab}
  for s in ${SRCS//+/ }; do
    echo "=== core $s $(date +%T)"
    timeout 150 "${CORE[@]}" --src "$T/$s" --requests 1,8,64 --budgets 16,64,256 \
      --stages "$(echo "${CORE_STAGES:-vocab,tree,full,step}" | tr + ,)" \
      --out "$OUT/core_$s.json" 2>&1 | tail -11
  done
  [ "${CORE_TESTS:-1}" = 1 ] || exit 0
  timeout 200 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rxXs \
    tests/test_ddtree_core.py tests/test_ddtree_vocab_threshold.py 2>&1 | tail -8 ;;
kernels)
  (cd tests/in_vllm && timeout 400 "$PYTHON" -m pytest -q -p no:cacheprovider -c pytest.ini \
    test_tree_attention_split.py test_ddtree_gdn.py test_ddtree_gdn_builder.py \
    test_ddtree_gdn_hybrid.py test_ddtree_gdn_commit.py test_ddtree_hybrid_runner.py \
    test_ddtree_tree_conv.py test_ddtree_kernels.py test_ddtree_launch_counts.py \
    test_gdn_float32_prefill.py) 2>&1 | tail -5 ;;
*) echo "usage: bash bench/kernels/gpu_checks.sh core|corestep|corevocab|kernels"; exit 2 ;;
esac
