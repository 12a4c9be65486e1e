#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# The GPU tests of the DDTree core and kernels on a GPU host, one stage per
# call (each within about ten minutes on an H200):
#
#   bash bench/kernels/gpu_checks.sh STAGE
#
#   core      the -m gpu core tests (tree build, vocabulary threshold)
#   kernels   the in-vLLM kernel tests on CUDA (tree attention, Gated DeltaNet
#             tree kernels, conv, state builder, runner checks)
#
# Environment: PYTHON (our wheel installed) [python3].
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.." || exit 2
PYTHON=${PYTHON:-python3}
STAGE=${1:-${STAGE:-}}
case "$STAGE" in
core)
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 200 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rxXs \
    tests/unit/test_ddtree_core.py tests/unit/test_ddtree_vocab_threshold.py 2>&1 | tail -8 ;;
kernels)
  (cd tests/in_vllm && timeout 400 "$PYTHON" -m pytest -q -p no:cacheprovider -c pytest.ini \
    test_tree_attention_split.py test_ddtree_gdn.py test_ddtree_gdn_builder.py \
    test_ddtree_gdn_hybrid.py test_ddtree_gdn_commit.py test_ddtree_hybrid_runner.py \
    test_ddtree_tree_conv.py test_ddtree_kernels.py test_ddtree_launch_counts.py \
    test_gdn_float32_prefill.py) 2>&1 | tail -5 ;;
*) echo "usage: bash bench/kernels/gpu_checks.sh core|kernels"; exit 2 ;;
esac
