#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# Stages of bench/gpu_validate.sh on the two GPUs of a two-GPU host side by
# side: one list of stages per GPU, each run in order. Use it for checks
# (exactness, serving, kernel tests, the matrix); keep the timings you
# compare with each other in one list (one GPU), as the two jobs share the
# host's CPUs.
#
#   bash bench/gpu_pair.sh "serve" "corevocab exact:BUDGETS=256"
#
# A stage is STAGE or STAGE:VAR=value,VAR=value (e.g. matrix:PART=b). The
# environment of gpu_validate.sh (MODELS, PYTHON, WORK, KEEP, REF_DIR, TREES,
# ...) passes through; both jobs share $KEEP. Each stage writes its results
# and logs under $WORK/pair/gpu<N>/; all of it, with both jobs' logs, is
# packed into $OUT/pair.tgz, and a summary of both jobs is printed at the
# end. PAIR_TIMEOUT (seconds, default 560) stops both jobs, so that the
# tarball is written before an outer time limit.
set -u
abspath() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
for v in MODELS WORK OUT KEEP MATRIX_DIR KV6 REF_DIR TREES SRC; do
  [ -n "${!v:-}" ] && export "$v=$(abspath "${!v}")"
done
cd "$(dirname "$0")/.." || exit 2
export WORK=${WORK:-/tmp/ddtree-bench}
export OUT=${OUT:-$WORK/out}
export KEEP=${KEEP:-$WORK/keep}
P=$WORK/pair
mkdir -p "$OUT" "$P"
job() {  # gpu, stage list
  local gpu=$1 spec stage vars
  for spec in $2; do
    stage=${spec%%:*}; vars=""
    [[ $spec == *:* ]] && vars=${spec#*:}
    echo "### gpu$gpu $spec start $(date +%T)"
    # shellcheck disable=SC2046
    env CUDA_VISIBLE_DEVICES="$gpu" OUT="$P/gpu$gpu/$stage" LOGDIR="$P/gpu$gpu/logs-$stage" \
      STAGE="$stage" $(echo "$vars" | tr ',' ' ') bash bench/gpu_validate.sh
    echo "### gpu$gpu $spec rc=$? end $(date +%T)"
  done > "$P/gpu$gpu.log" 2>&1
}
[ $# -eq 2 ] || { echo "usage: gpu_pair.sh 'STAGES for GPU 0' 'STAGES for GPU 1'"; exit 2; }
nvidia-smi --query-gpu=index,name --format=csv,noheader
export -f job
export P
timeout -k 10 "${PAIR_TIMEOUT:-560}" bash -c 'job 0 "$1"' _ "$1" &
timeout -k 10 "${PAIR_TIMEOUT:-560}" bash -c 'job 1 "$1"' _ "$2" &
wait
cp "$P/gpu0.log" "$P/gpu1.log" "$OUT/" 2>/dev/null
cp -r "$WORK/serve_e2e" "${MATRIX_DIR:-$WORK/matrix}" "$P/" 2>/dev/null
tar czf "$OUT/pair.tgz" -C "$WORK" pair
for g in 0 1; do echo "===== gpu$g"; tail -c 5000 "$P/gpu$g.log"; done
