#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# The GPU checks of the DDTree issues, in stages that each fit one 10-minute
# device call (run them back to back: the machine stays warm ~30 s after a
# call). Prerequisite on the GPU host: the devbundle of our wheel is unpacked
# (../shared/gpu/README.md: `make wheel`, then
# `python3 ../shared/gpu/make_bundle.py --wheel dist/vllm-*.whl --models ../shared/models/tinypair`,
# then send part-00.. with setup.sh).
#
#   STAGE=ref     bash bench/gpu_validate.sh   # no-spec float32 reference tokens (train+held-out)
#   STAGE=exact1  bash bench/gpu_validate.sh   # DDTree B=1, 16 (fixed), CUDA graphs, vs ref
#   STAGE=exact2  bash bench/gpu_validate.sh   # DDTree B=64 and 256 with enforce_eager, vs ref
#   STAGE=speed   bash bench/gpu_validate.sh   # chain vs DDTree batch policy, c=1 and 32
#   STAGE=core    bash bench/gpu_validate.sh   # core bench torch vs triton, -m gpu core/kernel tests
#   STAGE=dummy8b bash bench/gpu_validate.sh   # 8B-shaped dummy target: chain vs DDTree B=64 (bf16)
#   STAGE=sample  bash bench/gpu_validate.sh   # T=1 top-p 0.95 distribution check (issue 6)
#   STAGE=serve   bash bench/serve_e2e.sh      # 64 streaming clients with disconnects (issue 7)
#
# Reference tokens are kept in /tmp/keep between calls on the same machine.
set -u
source /tmp/site/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/keep; cp /tmp/keep/tokens_*.json "$OUT"/ 2>/dev/null
M=/tmp/models/tinypair; TRAIN=$M/prompts_train.jsonl; HELD=$M/prompts_heldout.jsonl
E8=bench/configs/qwen3-8b-dummy
ALL="--prompts $TRAIN $HELD --n 0 --c1-n 32 --conc 32 1"
run() {
  local tag=$1; shift
  echo "=== $tag $(date +%T)"
  timeout "${TMO:-280}" python3 bench/ddtree_e2e.py --target $M/target --drafter $M/drafter \
    --tag "$tag" "$@" > "$OUT/$tag.log" 2>&1
  echo "rc=$?"; grep -E "^RESULT|Error:" "$OUT/$tag.log" | tail -4
  cp "$OUT"/tokens_*.json /tmp/keep/ 2>/dev/null
}
case "${STAGE:-}" in
ref)    run ref --mode none $ALL ;;
exact1) run ddtree_b1 --mode ddtree --budget 1 --policy fixed --ref ref $ALL
        run ddtree_b16 --mode ddtree --budget 16 --policy fixed --ref ref $ALL ;;
exact2) TMO=280 run ddtree_b64_eager --mode ddtree --budget 64 --policy fixed --eager --ref ref $ALL
        TMO=280 run ddtree_b256_eager --mode ddtree --budget 256 --policy fixed --eager --ref ref $ALL ;;
speed)  run dflash_k15 --mode dflash --k 15 --ref ref $ALL
        run ddtree_b64_batch --mode ddtree --budget 64 --policy batch --ref ref $ALL
        run ddtree_b256_batch --mode ddtree --budget 256 --policy batch --ref ref $ALL ;;
core)   timeout 200 python3 bench/bench_ddtree_core.py --src /tmp/site --backend torch --out "$OUT/core_torch.json" | tail -12
        VLLM_DDTREE_BACKEND=triton timeout 200 python3 bench/bench_ddtree_core.py --src /tmp/site --backend triton --out "$OUT/core_triton.json" | tail -12
        VLLM_DDTREE_SRC=/tmp/site timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ddtree_core.py 2>&1 | tail -3
        (cd tests/in_vllm && timeout 120 python3 -m pytest -q -p no:cacheprovider -c pytest.ini -m "gpu or not gpu" test_ddtree_kernels.py test_tree_attention.py -k "kernel or compactor or gpu" 2>&1 | tail -3) ;;
dummy8b)
  for mode in "dflash --k 15" "ddtree --budget 64 --policy fixed"; do
    t=8b_$(echo "$mode" | cut -d' ' -f1)
    echo "=== $t $(date +%T)"
    timeout 280 python3 bench/ddtree_e2e.py --target $E8/target --drafter $E8/drafter \
      --load-format dummy --dtype bfloat16 --mode $mode --prompts $TRAIN --n 8 --conc 1 \
      --max-tokens 128 --tag "$t" --gpu-memory-utilization 0.6 > "$OUT/$t.log" 2>&1
    echo "rc=$?"; grep -E "^RESULT|Error:" "$OUT/$t.log" | tail -3
  done ;;
sample)
  for args in "--mode none --tag sref" "--drafter $M/drafter --mode dflash --k 15 --ref sref" \
              "--drafter $M/drafter --mode ddtree --budget 64 --ref sref --seeded-ref sref"; do
    timeout 280 python3 bench/ddtree_sampling.py --target $M/target $args 2>&1 | grep -E "^RESULT|Error:" | tail -2
  done ;;
*) echo "set STAGE (see the header)"; exit 2 ;;
esac
grep -h "^RESULT" "$OUT"/*.log 2>/dev/null
rm -f "$OUT"/tokens_*.json  # at most 8 files come back from the device
