#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# Stages of bench/gpu_validate.sh on the two GPUs of an nvidia-h200-x2 host
# side by side: one list of stages per GPU, each run in order, so that one
# device call does two GPUs' work. Use it for checks (exactness, serving,
# kernel tests, the matrix); keep the timings you compare with each other in
# one list (one GPU), as the two jobs share the host's CPUs.
#
#   bash bench/gpu_pair.sh "serve" "corevocab exact:BUDGETS=256"
#
# A stage is STAGE or STAGE:VAR=value,VAR=value (e.g. matrix:PART=b).
# Everything each stage writes ($OUT, its logs) comes back in one tarball,
# $OUT/pair.tgz (the device call returns at most 8 files); a summary of both
# jobs is printed at the end. PAIR_TIMEOUT (seconds, default 560) stops both
# jobs so that the tarball is written before the device call's own limit.
set -u
export OUT=${OUT:-/tmp/out}
P=/tmp/pair
mkdir -p "$OUT" $P
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
cp $P/gpu0.log $P/gpu1.log "$OUT/" 2>/dev/null
cp -r /tmp/serve_e2e /tmp/matrix $P/ 2>/dev/null
tar czf "$OUT/pair.tgz" -C /tmp pair
for g in 0 1; do echo "===== gpu$g"; tail -c 5000 $P/gpu$g.log; done
