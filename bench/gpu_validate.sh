#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# The GPU checks of the DDTree issues, in stages that each fit one 10-minute
# device call (run them back to back: the machine stays warm ~30 s after a
# call). Stage `core` needs only torch + Triton and the patched tree files
# (SRC=<dir holding vllm/v1/spec_decode/ddtree/>); the others need the
# devbundle of our wheel unpacked (../shared/gpu/README.md: `make wheel`, then
# `python3 ../shared/gpu/make_bundle.py --wheel dist/vllm-*.whl --models ../shared/models/tinypair`,
# then send part-00.. with setup.sh).
#
#   STAGE=core    SRC=... bash bench/gpu_validate.sh  # core bench torch vs triton, -m gpu core tests
#   STAGE=corestep bash bench/gpu_validate.sh # core bench incl. the runner's per-step kernels
#   STAGE=corevocab bash bench/gpu_validate.sh # the same, tree files from .gpu/src_base vs
#                                             # .gpu/src_vocab (a candidate change), + its GPU tests
#                                             # (SRCS=base+topk CANDIDATE=topk: another candidate)
#   STAGE=matrix PART=a|b|8b|t1|t1b|t1c bash bench/gpu_validate.sh  # issue-5 matrix (a, b: tinypair;
#                                             # 8b: 8B-shaped dummy; t1, t1b, t1c: T=1 rows), one call each
#   STAGE=speed   bash bench/gpu_validate.sh  # GPU kernel tests; chain K=15 vs DDTree (batch
#                                             # policy), train prompts, c=1/8/32, fp32
#   STAGE=profile bash bench/gpu_validate.sh  # no-spec ref (-> $OUT, carry back in .gpu/keep),
#                                             # step-time breakdown + host syncs, chain vs DDTree,
#                                             # c=1/8/32; c=32 exactness under VLLM_BATCH_INVARIANT
#   STAGE=breakdown BD=dflash|ddtree bash bench/gpu_validate.sh  # step-time breakdown only
#   STAGE=eightb  bash bench/gpu_validate.sh  # 8B-shaped dummy target: chain vs DDTree B=64 (bf16)
#   STAGE=exact   bash bench/gpu_validate.sh  # DDTree at BUDGETS (16 64 256; CUDA graphs, EAGER=1: not) vs ref
#   STAGE=preempt bash bench/gpu_validate.sh  # DDTree (BUDGETS) vs ref with a KV cache of NBLOCKS blocks
#   STAGE=exactbi bash bench/gpu_validate.sh  # the same under VLLM_BATCH_INVARIANT=1 (BUDGETS, EAGER=1)
#   STAGE=sample  bash bench/gpu_validate.sh  # T=1 top-p 0.95 distribution vs no-spec, seeded runs
#   STAGE=serve   bash bench/gpu_validate.sh  # vllm serve: 64 streams with disconnects vs no-spec
#   STAGE=hybrid  bash bench/gpu_validate.sh  # hybrid GDN on a dummy Qwen3.5 shape vs no-spec
#   STAGE=tp2     bash bench/gpu_validate.sh  # (2 GPUs) DDTree at TP=2 vs no-spec at TP=1, tinypair
#                                             # with its key/value heads repeated (6)
#
# One engine at a time: several vLLM engines starting on one GPU fail their
# memory profiling. Stage exact needs `ref` from `profile`.
#
# Reference tokens are kept in /tmp/keep between calls on the same machine;
# stage profile also returns them in $OUT (carry them back as .gpu/keep/).
# Logs go to one tarball ($OUT/logs-<stage>.tgz: at most 8 files come back).
set -u
export PYTHONUNBUFFERED=1
export OUT=${OUT:-/tmp/out}; L=${LOGDIR:-/tmp/logs}; mkdir -p "$OUT" /tmp/keep "$L"
M=/tmp/models/tinypair; TRAIN=$M/prompts_train.jsonl; HELD=$M/prompts_heldout.jsonl
E8=bench/configs/qwen3-8b-dummy
ALL="--prompts $TRAIN $HELD --n 0 --c1-n 32 --conc 32 1"
run() {  # tag, then ddtree_e2e.py args; env TMO, GPU_UTIL
  local tag=$1; shift
  echo "=== $tag $(date +%T)"
  timeout "${TMO:-280}" python3 bench/ddtree_e2e.py --target $M/target --drafter $M/drafter \
    --outdir /tmp/keep --tag "$tag" --gpu-memory-utilization "${GPU_UTIL:-0.5}" "$@" \
    > "$L/$tag.log" 2>&1
  echo "rc=$? $tag"; grep -E "^RESULT|^PROFILE|^SYNCCHECK|Error" "$L/$tag.log" | tail -4
}
finish() {
  grep -h "^RESULT\|^PROFILE\|^SYNCCHECK\|^E2E\|^TP2CMP" $L/*.log > "$OUT/results-$STAGE.txt" 2>/dev/null
  tar czf "$OUT/logs-$STAGE.tgz" -C "$(dirname "$L")" "$(basename "$L")" 2>/dev/null
}
trap finish EXIT
case "${STAGE:-}" in
core)
  S=${SRC:?set SRC}
  nvidia-smi --query-gpu=name --format=csv,noheader
  for b in triton torch; do
    timeout 120 python3 bench/bench_ddtree_core.py --src $S --backend $b --requests 1,8,64 \
      --budgets 16,64,256 --stages vocab,tree,core,full --iters 50 --out "$OUT/core_$b.json" 2>&1 | tail -11
  done
  timeout 40 python3 bench/bench_ddtree_core.py --src $S --backend triton --vocab 8192 --requests 1,32 \
    --budgets 64,256 --stages vocab,tree,core,full --iters 50 --out "$OUT/core_triton_v8k.json" 2>&1 | tail -5
  VLLM_DDTREE_SRC=$S timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -rxXs \
    tests/test_ddtree_core.py 2>&1 | tail -8 ;;
corestep)
  # DDTree core on the devbundle's vLLM: build stages plus the runner's own
  # per-step kernels (tree bias, walk, KV compaction over 8B-shaped KV).
  source /tmp/site/env.sh
  timeout 200 python3 bench/bench_ddtree_core.py --src /tmp/site --backend triton \
    --requests 1,8,32 --budgets 16,64 --stages vocab,tree,core,step --iters 50 \
    --out "$OUT/core_step.json" 2>&1 | tail -8
  timeout 100 python3 bench/bench_ddtree_core.py --src /tmp/site --backend triton --vocab 8192 \
    --requests 1,32 --budgets 64 --stages vocab,tree,step --iters 50 \
    --out "$OUT/core_step_v8k.json" 2>&1 | tail -4 ;;
corevocab)
  # A candidate change of the core's tree files against the current ones
  # (copy each tree into .gpu/src_<name>/vllm/v1/spec_decode/ddtree/ and
  # carry .gpu): build stages and the runner's step kernels, R = 1/8/64,
  # B = 16/64/256, V = 151936; then the core and vocabulary-pass GPU tests
  # on the candidate (CORE_TESTS=0: not). Without
  # the devbundle (torch + Triton only) the step column is left empty.
  # CORE_STAGES: the bench's stages, ',' or '+' between them.
  [ -f /tmp/site/env.sh ] && source /tmp/site/env.sh
  SRCS=${SRCS:-base vocab}
  for s in ${SRCS//+/ }; do  # '+' or ' ' between names (gpu_pair.sh specs have no spaces)
    echo "=== core $s $(date +%T)"
    timeout 150 python3 bench/bench_ddtree_core.py --src .gpu/src_$s --backend triton \
      --requests 1,8,64 --budgets 16,64,256 --stages "$(echo "${CORE_STAGES:-vocab,tree,full,step}" | tr + ,)" \
      --iters 50 --out "$OUT/core_$s.json" 2>&1 | tail -11
  done
  [ "${CORE_TESTS:-1}" = 1 ] || exit 0
  VLLM_DDTREE_SRC=.gpu/src_${CANDIDATE:-vocab} timeout 200 python3 -m pytest -q -p no:cacheprovider \
    -m gpu -rxXs tests/test_ddtree_core.py tests/test_ddtree_vocab_threshold.py \
    2>&1 | tail -8 ;;
matrix)
  # The issue-5 matrix in two calls: PART=a (no spec, chain K=7/15, DDTree
  # B=16) and PART=b (DDTree B=32/64/128/256), tinypair train prompts,
  # c = 1/4/8/16/32, float32, 128 new tokens; MATRIX_ARGS adds options
  # (e.g. --breakdown dflash_k15 ddtree_b64).
  # PART=8b: the 8B-shaped dummy target (bf16; verification cost against B,
  # acceptance meaningless). MATRIX_ARGS="--temperatures 0 1" adds sampled
  # rows (T = 1) of the same configurations.
  source /tmp/site/env.sh
  MT=$M; MDT=float32; MN=${N:-48}; MC="1 4 8 16 32"; MX=""
  case "${PART:-a}" in
    a) SEL="--chain 7 15 --budgets 16" ;;
    b) SEL="--skip-none --chain --budgets 32 64 128 256" ;;
    8b) SEL="--chain 15 --budgets 16 64 256"; MT=$E8; MDT=bfloat16; MN=${N:-8}; MC="1 4 8"
        MX="--load-format dummy" ;;
    # t1: the sampled rows (temperature 1) of no spec, the chain K=15 and
    # DDTree B=16/64 in one call (speed and tau; outputs not comparable).
    t1) SEL="--chain 15 --budgets 16 64 --temperatures 1" ;;
    # t1b, t1c: the other sampled rows, on the two GPUs of one host, each
    # with the chain K=15 again so that its ratios come from one list.
    t1b) SEL="--skip-none --chain 7 15 --budgets 32 --temperatures 1" ;;
    t1c) SEL="--skip-none --chain 15 --budgets 128 256 --temperatures 1" ;;
  esac
  timeout 590 python3 bench/run_matrix.py --target $MT/target --drafter $MT/drafter \
    --prompts $TRAIN --n $MN --max-tokens 128 --dtype $MDT --conc $MC $MX \
    $SEL ${MATRIX_ARGS:-} --out "/tmp/matrix/matrix_${PART:-a}"
  # JSON and PNGs only ($OUT takes at most 8 files; the token files stay).
  cp /tmp/matrix/matrix_${PART:-a}.json /tmp/matrix/matrix_${PART:-a}-*.png "$OUT/" 2>/dev/null ;;
speed)
  # (GPU kernel tests with KERNEL_TESTS=1;) chain K=15 against DDTree (default budget policy)
  # on the train prompts at c = 1, 8, 32, back to back.
  source /tmp/site/env.sh
  [ -n "${KERNEL_TESTS:-}" ] && (cd tests/in_vllm && TINYPAIR_DIR=$M timeout 100 python3 -m pytest -q \
     -p no:cacheprovider -c pytest.ini test_ddtree_kernels.py test_tree_attention.py 2>&1 | tail -3)
  TRN="--prompts $TRAIN --n 0 --c1-n 32 --conc 1 8 32"
  run dflash_k15 --mode dflash --k 15 $TRN
  run ddtree_batch --mode ddtree --budget 64 $TRN ;;
profile)
  # No-spec reference (Triton attention, as DDTree's target; top-2 logprob
  # gaps kept to classify divergences), copied to $OUT so that a later
  # session can carry it back in .gpu/keep; then the step-time breakdown and
  # host syncs of chain and DDTree at c = 1, 8, 32 (one engine each); then
  # the c=32 exactness pair under VLLM_BATCH_INVARIANT=1.
  source /tmp/site/env.sh
  cp .gpu/keep/* /tmp/keep/ 2>/dev/null
  [ -f /tmp/keep/tokens_ref_c32.json ] || \
    TMO=240 run ref --mode none --attention-backend TRITON_ATTN --save-gaps $ALL
  cp /tmp/keep/tokens_ref_c*.json /tmp/keep/gaps_ref_c*.json "$OUT/" 2>/dev/null
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
  source /tmp/site/env.sh
  case ${BD:-ddtree} in
    dflash) A="dflash --k 15" ;;
    *) A="ddtree --budget 64 --policy fixed" ;;
  esac
  TMO=${TMO:-200} run bd_${BD:-ddtree} --mode $A --prompts $TRAIN --profile 3 --conc 1 8 32 \
    --max-tokens 128 ;;
eightb)
  # The 8B-shaped dummy target (bf16): chain K=15 vs DDTree B=64, c=1.
  source /tmp/site/env.sh
  for mode in "dflash --k 15" "ddtree --budget 64 --policy fixed"; do
    t=8b_$(echo "$mode" | cut -d' ' -f1)
    echo "=== $t $(date +%T)"
    timeout 170 python3 bench/ddtree_e2e.py --target $E8/target --drafter $E8/drafter \
      --load-format dummy --dtype bfloat16 --mode $mode --prompts $TRAIN --n 8 --conc 1 \
      --max-tokens 128 --tag "$t" --outdir /tmp/keep --gpu-memory-utilization 0.6 > "$L/$t.log" 2>&1
    echo "rc=$? $t"; grep -E "^RESULT|Error" "$L/$t.log" | tail -3
  done ;;
exact)
  # Greedy exactness against the no-spec reference of stage profile
  # (carried back in .gpu/keep): B = 16, 64, 256 with CUDA graphs; TMO
  # seconds per engine (190; B = 256 needs about 250 on a shared host).
  # EAGER=1: under enforce_eager instead.
  # One engine at a time: vLLM engines starting side by side on one GPU fail
  # their memory profiling (seen 2026-11-29: "Error in memory profiling",
  # "No available memory for the cache blocks").
  source /tmp/site/env.sh
  cp .gpu/keep/* /tmp/keep/ 2>/dev/null
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
  source /tmp/site/env.sh
  cp .gpu/keep/* /tmp/keep/ 2>/dev/null
  for b in ${BUDGETS:-64}; do
    TMO=${TMO:-240} run ddtree_b${b}_preempt --mode ddtree --budget $b --policy fixed \
      --llm-kwargs "{\"num_gpu_blocks_override\": ${NBLOCKS:-256}}" --ref ref $ALL
  done ;;
exactbi)
  # Greedy exactness under VLLM_BATCH_INVARIANT=1: every row's matmuls and
  # attention reductions then do not depend on the batch or on the other
  # query rows (a tree node's masked keys add exact zeros), so DDTree should
  # equal no-spec bit for bit, near-ties included. Reference ref_bi (kept in
  # /tmp/keep; returned in $OUT to carry back in .gpu/keep), then DDTree at
  # BUDGETS (default 64) with CUDA graphs, or EAGER=1 for enforce_eager.
  # Batch-invariant kernels are slow: one or two budgets per call.
  source /tmp/site/env.sh
  cp .gpu/keep/* /tmp/keep/ 2>/dev/null
  export VLLM_BATCH_INVARIANT=1
  [ -f /tmp/keep/tokens_ref_bi_c32.json ] && [ -f /tmp/keep/tokens_ref_bi_c1.json ] || \
    TMO=240 run ref_bi --mode none --attention-backend TRITON_ATTN --save-gaps $ALL
  cp /tmp/keep/tokens_ref_bi_c*.json /tmp/keep/gaps_ref_bi_c*.json "$OUT/" 2>/dev/null
  for b in ${BUDGETS:-64}; do
    TMO=${TMO:-400} run ddtree_b${b}_bi${EAGER:+_eager} --mode ddtree --budget $b --policy fixed \
      ${EAGER:+--eager} --ref ref_bi $ALL
  done ;;
sample)
  # Chi-square of DDTree's first three tokens against no-spec sampling with
  # independent noise (engine seeds 0 and 1); seeded requests from two
  # processes running the same workload; the chain's tau at the same
  # settings (SAMPLE_CHAIN=1).
  source /tmp/site/env.sh
  S="timeout 170 python3 bench/ddtree_sampling.py --target $M/target --prompts $HELD --outdir /tmp/keep"
  { $S --mode none --tag sref
    $S --drafter $M/drafter --mode ddtree --budget 64 --seed 1 --ref sref --tag s_ddtree
    $S --drafter $M/drafter --mode ddtree --budget 64 --seed 1 --tag s_ddtree2 --seeded-ref s_ddtree
    [ -n "${SAMPLE_CHAIN:-}" ] && $S --drafter $M/drafter --mode dflash --k 15 --seed 1 --ref sref --tag s_dflash
  } > $L/sampling.log 2>&1
  grep -E "^RESULT|Error" $L/sampling.log ;;
hybrid)
  # Issue 8: the experimental hybrid GDN path on a dummy Qwen3.5-shaped target
  # (bench/configs/qwen35-hybrid-dummy; see bench/hybrid_stage.sh).
  LOGDIR=$L bash bench/hybrid_stage.sh ;;
tp2)
  # Tensor parallel 2 (two GPUs), issue 10. The tinypair has 3 key/value
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
  source /tmp/site/env.sh
  K6=/tmp/models/tinypair-kv6
  for m in target drafter; do python3 bench/expand_kv_heads.py $M/$m $K6/$m --kv-heads 6; done
  TPA="--prompts $TRAIN --n 64 --conc 8 1 --outdir /tmp/keep --gpu-memory-utilization 0.5"
  TP2='--llm-kwargs {"tensor_parallel_size":2}'
  echo "=== tp1_ref $(date +%T)"
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout 150 python3 bench/ddtree_e2e.py $TPA \
    --target $M/target --mode none --attention-backend TRITON_ATTN --save-gaps --tag tp1_ref \
    > $L/tp1_ref.log 2>&1
  echo "rc=$? tp1_ref"; grep -E "^RESULT|Error" $L/tp1_ref.log | tail -3
  echo "=== tp2_ddtree_b64 $(date +%T)"
  timeout 240 python3 bench/ddtree_e2e.py $TPA --target $K6/target --drafter $K6/drafter \
    --mode ddtree --budget 64 --policy fixed --ref tp1_ref $TP2 --tag tp2_ddtree_b64 \
    > $L/tp2_ddtree_b64.log 2>&1
  echo "rc=$? tp2_ddtree_b64"; grep -E "^RESULT|Error" $L/tp2_ddtree_b64.log | tail -3
  echo "=== tp2_none $(date +%T)"
  timeout "${TMO:-170}" python3 bench/ddtree_e2e.py $TPA --target $K6/target --mode none \
    --attention-backend TRITON_ATTN --ref tp1_ref $TP2 --tag tp2_none > $L/tp2_none.log 2>&1
  echo "rc=$? tp2_none"; grep -E "^RESULT|Error" $L/tp2_none.log | tail -3
  python3 - <<'EOF' | tee $L/tp2_compare.log
import json
for c in (8, 1):
    try:
        a, b = (json.load(open(f"/tmp/keep/tokens_{t}_c{c}.json")) for t in ("tp2_ddtree_b64", "tp2_none"))
    except OSError as e:
        print(f"TP2CMP c={c}: {e}")
        continue
    same = sum(x == y for x, y in zip(a, b))
    print(f"TP2CMP c={c}: DDTree TP=2 equal to no-spec TP=2 on {same}/{len(b)} prompts")
EOF
  ;;
serve)
  source /tmp/site/env.sh
  OUT=/tmp/serve_e2e timeout 500 bash bench/serve_e2e.sh > $L/serve_e2e.log 2>&1
  echo "serve_e2e rc=$?"; grep -E "^RESULT|^E2E|exit" $L/serve_e2e.log | tail -5 ;;
*) echo "set STAGE (see the header)"; exit 2 ;;
esac
