#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# GPU check of the hybrid (Gated DeltaNet) DDTree path on a dummy-weight
# Qwen3.5-architecture target with a dummy DFlash drafter (bench/configs/qwen35-hybrid-dummy):
#
#   (e) the hybrid kernel tests of tests/in_vllm, on CUDA;
#   (a) no-spec reference, float32, TRITON_ATTN, V2 model runner (the one
#       DDTree forces), top-2 gaps saved;
#   (b) DDTree B=16, (c) DDTree B=64 (fixed policy, CUDA graphs) against it:
#       64 train prompts at concurrency 8 and 1, 128 new tokens, float32;
#   (d) DDTree B=64 in bf16 at c=8 and c=1 (must complete; no reference).
#   V1_REF=1 adds a no-spec run on the V1 runner compared with (a).
#
# Needs a python with our wheel installed (PYTHON, default python3) and the
# tinypair's train prompts (MODELS, as in bench/gpu_validate.sh: default
# $TINYPAIR_DIR, else ../shared/models/tinypair beside the checkout); the
# caller sets CUDA_VISIBLE_DEVICES. One engine at a time. Every run has a
# timeout, capped so that the whole stage ends within TOTAL seconds (540).
# Scratch under WORK (/tmp/ddtree-bench): logs in LOGDIR ($WORK/logs,
# hybrid_*.log), tokens in $KEEP/hybrid ($WORK/keep/hybrid); RESULT lines
# also in $OUT/results-hybrid.txt ($WORK/out). GDN_PREFILL picks the GDN
# prefill backend (triton).
#
#   bash bench/hybrid_stage.sh
set -u
abspath() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
for v in MODELS WORK OUT LOGDIR KEEP; do
  [ -n "${!v:-}" ] && export "$v=$(abspath "${!v}")"
done
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
MODELS=${MODELS:-${TINYPAIR_DIR:-$PWD/../shared/models/tinypair}}
WORK=${WORK:-/tmp/ddtree-bench}
# Qwen3.5's GDN layer imports compressed_tensors, which needs loguru (both
# come with our wheel's dependencies).
"$PYTHON" -c "import loguru" 2>/dev/null || echo "warning: loguru is not importable; Qwen3.5 will not load"
export PYTHONUNBUFFERED=1
export OUT=${OUT:-$WORK/out}
H=bench/configs/qwen35-hybrid-dummy
TRAIN=$MODELS/prompts_train.jsonl
L=${LOGDIR:-$WORK/logs}; K=${KEEP:-$WORK/keep}/hybrid
mkdir -p "$OUT" "$L" "$K"
START=$SECONDS; TOTAL=${TOTAL:-540}
# Text only (vision tower skipped), no prefix caching (the hybrid tree path
# refuses it), Triton/FLA GDN prefill by default (auto picks FlashInfer on
# Hopper). The same for the reference and the DDTree runs.
KW="{\"enable_prefix_caching\": false, \"limit_mm_per_prompt\": {\"image\": 0, \"video\": 0}, \"gdn_prefill_backend\": \"${GDN_PREFILL:-triton}\"}"
COMMON=(--target "$H/target" --drafter "$H/drafter" --load-format dummy --prompts "$TRAIN"
  --n 64 --max-tokens 128 --gpu-memory-utilization 0.4 --outdir "$K" --llm-kwargs "$KW")
[ -n "${C1N:-}" ] && COMMON+=(--c1-n "$C1N")

left() { echo $((TOTAL - (SECONDS - START))); }
run() {  # tag, timeout (s), then ddtree_e2e.py args
  local tag=$1 tmo=$2; shift 2
  local cap; cap=$(($(left) - 5))
  [ "$cap" -lt "$tmo" ] && tmo=$cap
  if [ "$tmo" -lt 40 ]; then echo "=== $tag skipped (stage time spent)"; return; fi
  echo "=== $tag $(date +%T) (timeout ${tmo}s)"
  timeout "$tmo" "$PYTHON" bench/ddtree_e2e.py "${COMMON[@]}" --tag "$tag" "$@" \
    > "$L/hybrid_$tag.log" 2>&1
  echo "rc=$? $tag"
  grep -E "^RESULT|Error|error:" "$L/hybrid_$tag.log" | tail -4
}
finish() {
  echo "=== summary ($((SECONDS - START)) s)"
  grep -h "experimental hybrid\|GDN prefill kernel" "$L"/hybrid_*.log 2>/dev/null | sort -u | cut -c1-200
  grep -h "^RESULT" "$L"/hybrid_*.log 2>/dev/null | tee "$OUT/results-hybrid.txt"
  (cd "$L" && tar czf "$OUT/logs-hybrid.tgz" hybrid_*.log) 2>/dev/null
}
trap finish EXIT
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader

# HYBRID_RUNS picks the runs ('+'-separated; default all, in this order):
# kernel, ref, b16, b64, bf16. An engine start of this target takes 75-155 s
# in float32 and over 200 s in bf16 on a fresh machine (compile, kernel
# warm-up, CUDA graphs), so all five take more than ten minutes:
# split them, e.g. with bench/gpu_pair.sh over two GPUs of one machine
# ("hybrid:HYBRID_RUNS=kernel+ref+b16" then "hybrid:HYBRID_RUNS=b64" on one,
# "hybrid:HYBRID_RUNS=bf16" on the other; b16/b64 need ref's tokens).
RUNS="+${HYBRID_RUNS:-kernel+ref+b16+b64+bf16}+"
want() { [[ $RUNS == *"+$1+"* ]]; }

# (e) Hybrid kernel tests (GDN tree kernels, conv, state builder, runner
# checks, float32 prefill) on CUDA.
if want kernel; then
echo "=== kernel tests $(date +%T)"
(cd tests/in_vllm && env TINYPAIR_DIR="$MODELS" \
  timeout 240 "$PYTHON" -m pytest -q \
  -p no:cacheprovider -c pytest.ini test_ddtree_gdn.py test_ddtree_gdn_builder.py \
  test_ddtree_gdn_hybrid.py test_ddtree_gdn_commit.py test_ddtree_hybrid_runner.py \
  test_ddtree_tree_conv.py test_ddtree_kernels.py test_ddtree_launch_counts.py \
  test_gdn_float32_prefill.py) > "$L/hybrid_kernel_tests.log" 2>&1
echo "rc=$? kernel tests"; tail -3 "$L/hybrid_kernel_tests.log"
fi

# (a) Reference: no speculation, on the V2 runner (a hybrid target defaults
# to V1; DDTree forces V2).
want ref && VLLM_USE_V2_MODEL_RUNNER=1 run ref 240 --mode none --attention-backend TRITON_ATTN \
  --dtype float32 --save-gaps --conc 8 1
# (b), (c) DDTree vs the reference (CUDA graphs on).
for b in 16 64; do
  want b$b && run ddtree_b$b 240 --mode ddtree --budget $b --policy fixed --dtype float32 --ref ref --conc 8 1
done
# (d) bf16: must complete.
# On a fresh machine its start alone takes over 200 s (torch.compile, then
# the bf16 chunked-prefill kernels' warm-up: 83 s): cut twice at 185-200 s,
# completed with a 540 s limit (start 267 s; 2026-11-30).
# BF16_TMO: its timeout (360 s; give it the whole TOTAL when it runs alone).
want bf16 && run bf16_ddtree_b64 "${BF16_TMO:-360}" --mode ddtree --budget 64 --policy fixed \
  --dtype bfloat16 --conc 8 1
# Optional: the V1 runner's no-spec output against the V2 reference.
[ -n "${V1_REF:-}" ] && VLLM_USE_V2_MODEL_RUNNER=0 run ref_v1 120 --mode none \
  --attention-backend TRITON_ATTN --dtype float32 --ref ref --conc 8 1
exit 0
