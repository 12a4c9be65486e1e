#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# The GPU checks and benchmarks of DDTree, in stages sized to finish within
# about ten minutes each on an H200 (bench/gpu_pair.sh runs two lists of them
# on a two-GPU host). Run from anywhere on a GPU host whose python has our
# wheel installed; the stage is the first argument or $STAGE:
#
#   bash bench/gpu_validate.sh STAGE          # or: STAGE=... bash bench/gpu_validate.sh
#
#   core      core bench torch vs triton, -m gpu core tests (torch + Triton
#             suffice: the installed vLLM's DDTree, else the checkout's overlay/;
#             SRC=DIR: DIR/vllm/v1/spec_decode/ddtree/ files replace its files)
#   corestep  core bench incl. the runner's per-step kernels (vLLM installed;
#             SRC as for core)
#   corevocab TREES=DIR: the core bench for several tree variants
#             DIR/<name>/vllm/... (SRCS="base vocab": their names), then the GPU
#             core tests on the imported modules (CORE_TESTS=0: none;
#             CORE_STAGES: the bench's stages)
#   matrix    PART=a|b|8b|t1|t1b|t1c: the benchmark matrix (a, b: tinypair;
#             8b: 8B-shaped dummy; t1, t1b, t1c: T=1 rows), one part per run
#   speed     chain K=15 vs DDTree (batch policy), train prompts, c=1/8/32, fp32
#             (KERNEL_TESTS=1: the GPU kernel tests first)
#   profile   no-spec reference (-> $KEEP and $OUT), step-time breakdown + host
#             syncs, chain vs DDTree, c=1/8/32; c=32 exactness under
#             VLLM_BATCH_INVARIANT=1
#   breakdown BD=dflash|ddtree: step-time breakdown only
#   eightb    8B-shaped dummy target: chain vs DDTree B=64 (bf16)
#   exact     DDTree at BUDGETS (16 64 256; CUDA graphs, EAGER=1: not) vs the reference
#   preempt   DDTree (BUDGETS, 64) vs the reference with a KV cache of NBLOCKS (256) blocks
#   exactbi   the same as exact under VLLM_BATCH_INVARIANT=1 (BUDGETS, EAGER=1)
#   sample    T=1 top-p 0.95 distribution vs no-spec, seeded runs (SAMPLE_CHAIN=1: + chain)
#   serve     vllm serve: 64 streams with disconnects vs no-spec (bench/serve_e2e.sh)
#   hybrid    hybrid GDN on a dummy Qwen3.5 shape vs no-spec (bench/hybrid_stage.sh)
#   tp2       (2 GPUs) DDTree at TP=2 vs no-spec at TP=1, tinypair with its
#             key/value heads repeated (6)
#
# Environment (defaults in brackets):
#   MODELS   the model pair: DIR/target, DIR/drafter, DIR/prompts_train.jsonl,
#            DIR/prompts_heldout.jsonl [$TINYPAIR_DIR, else ../shared/models/tinypair
#            beside the checkout]
#   PYTHON   the interpreter with our wheel installed [python3]
#   WORK     scratch root [/tmp/ddtree-bench]; OUT results [$WORK/out],
#            LOGDIR logs [$WORK/logs], KEEP token files of every run, the
#            references included [$WORK/keep], MATRIX_DIR [$WORK/matrix],
#            KV6 the 6-head copy of tp2 [$WORK/tinypair-kv6]
#   REF_DIR  reference token files of an earlier `profile` / `exactbi` run
#            (its $OUT), copied into $KEEP first (exact, preempt, exactbi need them)
#   TMO      seconds per engine (per stage default); GPU_UTIL [0.5]
#
# One engine at a time: several vLLM engines starting on one GPU fail their
# memory profiling. Stage exact needs `ref` from `profile` (same $KEEP, or REF_DIR).
# RESULT lines go to $OUT/results-<stage>.txt, logs to $OUT/logs-<stage>.tgz.
set -u
export PYTHONUNBUFFERED=1
abspath() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
for v in MODELS WORK OUT LOGDIR KEEP MATRIX_DIR KV6 REF_DIR TREES SRC; do
  [ -n "${!v:-}" ] && export "$v=$(abspath "${!v}")"
done
cd "$(dirname "$0")/.." || exit 2
export PYTHON=${PYTHON:-python3}
export MODELS=${MODELS:-${TINYPAIR_DIR:-$PWD/../shared/models/tinypair}}
export WORK=${WORK:-/tmp/ddtree-bench}
export OUT=${OUT:-$WORK/out} KEEP=${KEEP:-$WORK/keep}
L=${LOGDIR:-$WORK/logs}
mkdir -p "$OUT" "$KEEP" "$L"
[ $# -ge 1 ] && STAGE=$1
STAGE=${STAGE:-}
[ -n "$STAGE" ] || { echo "usage: bash bench/gpu_validate.sh STAGE (or STAGE=...; the stages are in the header)"; exit 2; }
M=$MODELS; TRAIN=$M/prompts_train.jsonl; HELD=$M/prompts_heldout.jsonl
E8=bench/configs/qwen3-8b-dummy
ALL="--prompts $TRAIN $HELD --n 0 --c1-n 32 --conc 32 1"
run() {  # tag, then ddtree_e2e.py args; env TMO, GPU_UTIL
  local tag=$1; shift
  echo "=== $tag $(date +%T)"
  timeout "${TMO:-280}" "$PYTHON" bench/ddtree_e2e.py --target "$M/target" --drafter "$M/drafter" \
    --outdir "$KEEP" --tag "$tag" --gpu-memory-utilization "${GPU_UTIL:-0.5}" "$@" \
    > "$L/$tag.log" 2>&1
  echo "rc=$? $tag"; grep -E "^RESULT|^PROFILE|^SYNCCHECK|Error" "$L/$tag.log" | tail -4
}
use_refs() {  # reference token files of an earlier run, when REF_DIR names them
  [ -n "${REF_DIR:-}" ] && cp "$REF_DIR"/*.json "$KEEP/" 2>/dev/null
  return 0
}
finish() {
  grep -h "^RESULT\|^PROFILE\|^SYNCCHECK\|^E2E\|^TP2CMP" "$L"/*.log > "$OUT/results-$STAGE.txt" 2>/dev/null
  tar czf "$OUT/logs-$STAGE.tgz" -C "$(dirname "$L")" "$(basename "$L")" 2>/dev/null
}
trap finish EXIT
case "${STAGE:-}" in
core)
  nvidia-smi --query-gpu=name --format=csv,noheader
  for b in triton torch; do
    timeout 120 "$PYTHON" bench/bench_ddtree_core.py ${SRC:+--src "$SRC"} --backend $b --requests 1,8,64 \
      --budgets 16,64,256 --stages vocab,tree,core,full --iters 50 --out "$OUT/core_$b.json" 2>&1 | tail -11
  done
  timeout 40 "$PYTHON" bench/bench_ddtree_core.py ${SRC:+--src "$SRC"} --backend triton --vocab 8192 --requests 1,32 \
    --budgets 64,256 --stages vocab,tree,core,full --iters 50 --out "$OUT/core_triton_v8k.json" 2>&1 | tail -5
  timeout 100 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rxXs \
    tests/test_ddtree_core.py 2>&1 | tail -8 ;;
corestep)
  # DDTree core of the installed vLLM (SRC: variants of its files): build
  # stages plus the runner's own per-step kernels (tree bias, walk, KV
  # compaction over 8B-shaped KV).
  timeout 200 "$PYTHON" bench/bench_ddtree_core.py ${SRC:+--src "$SRC"} --backend triton \
    --requests 1,8,32 --budgets 16,64 --stages vocab,tree,core,step --iters 50 \
    --out "$OUT/core_step.json" 2>&1 | tail -8
  timeout 100 "$PYTHON" bench/bench_ddtree_core.py ${SRC:+--src "$SRC"} --backend triton --vocab 8192 \
    --requests 1,32 --budgets 64 --stages vocab,tree,step --iters 50 \
    --out "$OUT/core_step_v8k.json" 2>&1 | tail -4 ;;
corevocab)
  # A candidate change of the core's tree files against the current ones
  # (each tree in $TREES/<name>/vllm/v1/spec_decode/ddtree/, holding the
  # files that replace the imported vLLM's): build stages and the runner's
  # step kernels, R = 1/8/64, B = 16/64/256, V = 151936; then the core and
  # vocabulary-pass GPU tests on the imported modules (the installed vLLM's,
  # else overlay/: put the candidate there to test it; CORE_TESTS=0: not).
  # Without vLLM importable (torch + Triton only) the step column is left
  # empty. CORE_STAGES: the bench's stages, ',' or '+' between them.
  T=${TREES:?set TREES to a directory with one tree per name in SRCS}
  SRCS=${SRCS:-base vocab}
  for s in ${SRCS//+/ }; do  # '+' or ' ' between names (gpu_pair.sh specs have no spaces)
    echo "=== core $s $(date +%T)"
    timeout 150 "$PYTHON" bench/bench_ddtree_core.py --src "$T/$s" --backend triton \
      --requests 1,8,64 --budgets 16,64,256 --stages "$(echo "${CORE_STAGES:-vocab,tree,full,step}" | tr + ,)" \
      --iters 50 --out "$OUT/core_$s.json" 2>&1 | tail -11
  done
  [ "${CORE_TESTS:-1}" = 1 ] || exit 0
  timeout 200 "$PYTHON" -m pytest -q -p no:cacheprovider \
    -m gpu -rxXs tests/test_ddtree_core.py tests/test_ddtree_vocab_threshold.py \
    2>&1 | tail -8 ;;
matrix)
  # The benchmark matrix in two runs: PART=a (no spec, chain K=7/15, DDTree
  # B=16) and PART=b (DDTree B=32/64/128/256), tinypair train prompts,
  # c = 1/4/8/16/32, float32, 128 new tokens; MATRIX_ARGS adds options
  # (e.g. --breakdown dflash_k15 ddtree_b64).
  # PART=8b: the 8B-shaped dummy target (bf16; verification cost against B,
  # acceptance meaningless). MATRIX_ARGS="--temperatures 0 1" adds sampled
  # rows (T = 1) of the same configurations.
  MX_DIR=${MATRIX_DIR:-$WORK/matrix}
  MT=$M; MDT=float32; MN=${N:-48}; MC="1 4 8 16 32"; MX=""
  case "${PART:-a}" in
    a) SEL="--chain 7 15 --budgets 16" ;;
    b) SEL="--skip-none --chain --budgets 32 64 128 256" ;;
    8b) SEL="--chain 15 --budgets 16 64 256"; MT=$E8; MDT=bfloat16; MN=${N:-8}; MC="1 4 8"
        MX="--load-format dummy" ;;
    # t1: the sampled rows (temperature 1) of no spec, the chain K=15 and
    # DDTree B=16/64 in one run (speed and tau; outputs not comparable).
    t1) SEL="--chain 15 --budgets 16 64 --temperatures 1" ;;
    # t1b, t1c: the other sampled rows, on the two GPUs of one host, each
    # with the chain K=15 again so that its ratios come from one list.
    t1b) SEL="--skip-none --chain 7 15 --budgets 32 --temperatures 1" ;;
    t1c) SEL="--skip-none --chain 15 --budgets 128 256 --temperatures 1" ;;
  esac
  # shellcheck disable=SC2086
  timeout 590 "$PYTHON" bench/run_matrix.py --target "$MT/target" --drafter "$MT/drafter" \
    --prompts "$TRAIN" --n $MN --max-tokens 128 --dtype $MDT --conc $MC $MX \
    $SEL ${MATRIX_ARGS:-} --out "$MX_DIR/matrix_${PART:-a}"
  # The JSON and PNGs to $OUT (the token files stay in $MX_DIR).
  cp "$MX_DIR/matrix_${PART:-a}.json" "$MX_DIR/matrix_${PART:-a}"-*.png "$OUT/" 2>/dev/null ;;
speed)
  # (GPU kernel tests with KERNEL_TESTS=1;) chain K=15 against DDTree (default budget policy)
  # on the train prompts at c = 1, 8, 32, back to back.
  [ -n "${KERNEL_TESTS:-}" ] && (cd tests/in_vllm && TINYPAIR_DIR=$M timeout 100 "$PYTHON" -m pytest -q \
     -p no:cacheprovider -c pytest.ini test_ddtree_kernels.py test_tree_attention.py 2>&1 | tail -3)
  TRN="--prompts $TRAIN --n 0 --c1-n 32 --conc 1 8 32"
  run dflash_k15 --mode dflash --k 15 $TRN
  run ddtree_batch --mode ddtree --budget 64 $TRN ;;
profile)
  # No-spec reference (Triton attention, as DDTree's target; top-2 logprob
  # gaps kept to classify divergences) in $KEEP, also copied to $OUT (pass
  # that directory as REF_DIR on another host); then the step-time breakdown
  # and host syncs of chain and DDTree at c = 1, 8, 32 (one engine each);
  # then the c=32 exactness pair under VLLM_BATCH_INVARIANT=1.
  use_refs
  [ -f "$KEEP/tokens_ref_c32.json" ] || \
    TMO=240 run ref --mode none --attention-backend TRITON_ATTN --save-gaps $ALL
  cp "$KEEP"/tokens_ref_c*.json "$KEEP"/gaps_ref_c*.json "$OUT/" 2>/dev/null
  for mode in "dflash --k 15" "ddtree --budget 64"; do
    TMO=170 run prof_$(echo "$mode" | cut -d' ' -f1) --mode $mode --prompts $TRAIN \
      --profile 3 --conc 1 8 32 --sync-check 4 --max-tokens 128
  done
  BI="--prompts $TRAIN $HELD --n 0 --conc 32"
  VLLM_BATCH_INVARIANT=1 TMO=110 run ref_bi --mode none --attention-backend TRITON_ATTN \
    --save-gaps $BI
  VLLM_BATCH_INVARIANT=1 TMO=130 run ddtree_b64_bi --mode ddtree --budget 64 --policy fixed \
    --ref ref_bi $BI ;;
breakdown)
  # The step-time breakdown alone (stage profile's middle part, without its
  # host-sync count): BD=dflash (chain K=15) or BD=ddtree (B=64, fixed), train
  # prompts, 3 batches at c = 1, 8, 32; PROFILE lines for plot_results.py.
  case ${BD:-ddtree} in
    dflash) A="dflash --k 15" ;;
    *) A="ddtree --budget 64 --policy fixed" ;;
  esac
  TMO=${TMO:-200} run bd_${BD:-ddtree} --mode $A --prompts $TRAIN --profile 3 --conc 1 8 32 \
    --max-tokens 128 ;;
eightb)
  # The 8B-shaped dummy target (bf16): chain K=15 vs DDTree B=64, c=1.
  for mode in "dflash --k 15" "ddtree --budget 64 --policy fixed"; do
    t=8b_$(echo "$mode" | cut -d' ' -f1)
    echo "=== $t $(date +%T)"
    timeout 170 "$PYTHON" bench/ddtree_e2e.py --target $E8/target --drafter $E8/drafter \
      --load-format dummy --dtype bfloat16 --mode $mode --prompts "$TRAIN" --n 8 --conc 1 \
      --max-tokens 128 --tag "$t" --outdir "$KEEP" --gpu-memory-utilization 0.6 > "$L/$t.log" 2>&1
    echo "rc=$? $t"; grep -E "^RESULT|Error" "$L/$t.log" | tail -3
  done ;;
exact)
  # Greedy exactness against the no-spec reference of stage profile
  # (in $KEEP, or copied from REF_DIR): B = 16, 64, 256 with CUDA graphs; TMO
  # seconds per engine (190; B = 256 needs about 250 on a shared host).
  # EAGER=1: under enforce_eager instead.
  # One engine at a time: vLLM engines starting side by side on one GPU fail
  # their memory profiling (seen 2026-11-29: "Error in memory profiling",
  # "No available memory for the cache blocks").
  use_refs
  for b in ${BUDGETS:-16 64 256}; do
    TMO=${TMO:-190} run ddtree_b$b${EAGER:+_eager} --mode ddtree --budget $b --policy fixed \
      ${EAGER:+--eager} --ref ref $ALL
  done ;;
preempt)
  # Preemption loses nothing: the KV cache cut to NBLOCKS blocks of 16
  # tokens (default 256: a handful of the 32 concurrent requests fit, the
  # others are preempted and recomputed), DDTree at BUDGETS (default 64)
  # against the no-spec reference of stage profile; RESULT's "preemptions"
  # says how many happened.
  use_refs
  for b in ${BUDGETS:-64}; do
    TMO=${TMO:-240} run ddtree_b${b}_preempt --mode ddtree --budget $b --policy fixed \
      --llm-kwargs "{\"num_gpu_blocks_override\": ${NBLOCKS:-256}}" --ref ref $ALL
  done ;;
exactbi)
  # Greedy exactness under VLLM_BATCH_INVARIANT=1: every row's matmuls and
  # attention reductions then do not depend on the batch or on the other
  # query rows (a tree node's masked keys add exact zeros), so DDTree should
  # equal no-spec bit for bit, near-ties included. Reference ref_bi (kept in
  # $KEEP, also copied to $OUT for REF_DIR elsewhere), then DDTree at
  # BUDGETS (default 64) with CUDA graphs, or EAGER=1 for enforce_eager.
  # Batch-invariant kernels are slow: one or two budgets per run.
  use_refs
  export VLLM_BATCH_INVARIANT=1
  [ -f "$KEEP/tokens_ref_bi_c32.json" ] && [ -f "$KEEP/tokens_ref_bi_c1.json" ] || \
    TMO=240 run ref_bi --mode none --attention-backend TRITON_ATTN --save-gaps $ALL
  cp "$KEEP"/tokens_ref_bi_c*.json "$KEEP"/gaps_ref_bi_c*.json "$OUT/" 2>/dev/null
  for b in ${BUDGETS:-64}; do
    TMO=${TMO:-400} run ddtree_b${b}_bi${EAGER:+_eager} --mode ddtree --budget $b --policy fixed \
      ${EAGER:+--eager} --ref ref_bi $ALL
  done ;;
sample)
  # Chi-square of DDTree's first three tokens against no-spec sampling with
  # independent noise (engine seeds 0 and 1); seeded requests from two
  # processes running the same workload; the chain's tau at the same
  # settings (SAMPLE_CHAIN=1).
  S="timeout 170 $PYTHON bench/ddtree_sampling.py --target $M/target --prompts $HELD --outdir $KEEP"
  { $S --mode none --tag sref
    $S --drafter $M/drafter --mode ddtree --budget 64 --seed 1 --ref sref --tag s_ddtree
    $S --drafter $M/drafter --mode ddtree --budget 64 --seed 1 --tag s_ddtree2 --seeded-ref s_ddtree
    [ -n "${SAMPLE_CHAIN:-}" ] && $S --drafter $M/drafter --mode dflash --k 15 --seed 1 --ref sref --tag s_dflash
  } > "$L/sampling.log" 2>&1
  grep -E "^RESULT|Error" "$L/sampling.log" ;;
hybrid)
  # The experimental hybrid GDN path on a dummy Qwen3.5-shaped target
  # (bench/configs/qwen35-hybrid-dummy; see bench/hybrid_stage.sh).
  LOGDIR=$L bash bench/hybrid_stage.sh ;;
tp2)
  # Tensor parallel 2 (two GPUs). The tinypair has 3 key/value
  # heads, which TP = 2 cannot split: bench/expand_kv_heads.py copies the
  # pair with each key/value head repeated (6), the same function (equal
  # logits in transformers, tests/in_vllm/test_expand_kv_heads.py). Dummy
  # weights are no use here: their logits are flat (top-2 gaps ~1e-6 nats at
  # every token, seen 2026-11-30), so TP = 1 and TP = 2 differ at token 0.
  # float32, 64 train prompts at c = 8 and 1, 256 new tokens, CUDA graphs:
  # no-spec at TP = 1 on the original pair (reference), DDTree B = 64 at
  # TP = 2 on the copy against it, then no-spec at TP = 2 (how far TP = 2
  # alone moves greedy outputs: near-ties) and the two TP = 2 runs compared.
  # Keep the host's NCCL multicast switches (NCCL_NVLS_ENABLE).
  K6=${KV6:-$WORK/tinypair-kv6}
  for m in target drafter; do "$PYTHON" bench/expand_kv_heads.py "$M/$m" "$K6/$m" --kv-heads 6; done
  TPA="--prompts $TRAIN --n 64 --conc 8 1 --outdir $KEEP --gpu-memory-utilization 0.5"
  TP2='--llm-kwargs {"tensor_parallel_size":2}'
  echo "=== tp1_ref $(date +%T)"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout 150 "$PYTHON" bench/ddtree_e2e.py $TPA \
    --target "$M/target" --mode none --attention-backend TRITON_ATTN --save-gaps --tag tp1_ref \
    > "$L/tp1_ref.log" 2>&1
  echo "rc=$? tp1_ref"; grep -E "^RESULT|Error" "$L/tp1_ref.log" | tail -3
  echo "=== tp2_ddtree_b64 $(date +%T)"
  # shellcheck disable=SC2086
  timeout 240 "$PYTHON" bench/ddtree_e2e.py $TPA --target "$K6/target" --drafter "$K6/drafter" \
    --mode ddtree --budget 64 --policy fixed --ref tp1_ref $TP2 --tag tp2_ddtree_b64 \
    > "$L/tp2_ddtree_b64.log" 2>&1
  echo "rc=$? tp2_ddtree_b64"; grep -E "^RESULT|Error" "$L/tp2_ddtree_b64.log" | tail -3
  echo "=== tp2_none $(date +%T)"
  # shellcheck disable=SC2086
  timeout "${TMO:-170}" "$PYTHON" bench/ddtree_e2e.py $TPA --target "$K6/target" --mode none \
    --attention-backend TRITON_ATTN --ref tp1_ref $TP2 --tag tp2_none > "$L/tp2_none.log" 2>&1
  echo "rc=$? tp2_none"; grep -E "^RESULT|Error" "$L/tp2_none.log" | tail -3
  "$PYTHON" - <<'EOF' | tee "$L/tp2_compare.log"
import json, os
keep = os.environ["KEEP"]
for c in (8, 1):
    try:
        a, b = (json.load(open(f"{keep}/tokens_{t}_c{c}.json")) for t in ("tp2_ddtree_b64", "tp2_none"))
    except OSError as e:
        print(f"TP2CMP c={c}: {e}")
        continue
    same = sum(x == y for x, y in zip(a, b))
    print(f"TP2CMP c={c}: DDTree TP=2 equal to no-spec TP=2 on {same}/{len(b)} prompts")
EOF
  ;;
serve)
  OUT=$WORK/serve_e2e timeout 500 bash bench/serve_e2e.sh > "$L/serve_e2e.log" 2>&1
  echo "serve_e2e rc=$?"; grep -E "^RESULT|^E2E|exit" "$L/serve_e2e.log" | tail -5 ;;
*) echo "usage: bash bench/gpu_validate.sh STAGE (or STAGE=...; the stages are in the header)"; exit 2 ;;
esac
