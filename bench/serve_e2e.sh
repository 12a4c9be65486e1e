#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# End-to-end serving check of DDTree on a GPU host (about 4-8 minutes):
#   0. a bad DDTree config stops `vllm serve` with one line (exit != 0);
#   1. a no-spec server (float32, tinypair) answers the reference run;
#   2. a DDTree server takes the same requests, 64 concurrent streams, ~25% of
#      them cut mid-stream by the client; completed outputs must equal the
#      reference, the server must stay up and drain, /metrics must move.
# Servers listen on 127.0.0.1 only. Prints the RESULT lines of serve_load.py
# and a final `E2E {json}` line; exit 0 only when every step passed.
#
#   bash bench/serve_e2e.sh
#
# Environment (defaults in brackets): MODELS, the pair's directory (target/,
# drafter/, prompts_heldout.jsonl) [$TINYPAIR_DIR, else
# ../shared/models/tinypair beside the checkout]; PYTHON, the interpreter
# with our wheel installed [python3]; OUT, logs and results
# [${WORK:-/tmp/ddtree-bench}/serve_e2e]; PORT [8000]; N, requests and
# concurrency [64]; MAX_TOKENS [128]; BUDGET, DEPTH (tree_budget,
# draft_depth) [64, 15]; MAX_NUM_SEQS [128]; GPU_UTIL
# (--gpu-memory-utilization) [0.9]; START_TIMEOUT, seconds per server start
# [200]; PROMPTS [$MODELS/prompts_heldout.jsonl]; REF_ARGS, extra arguments
# of the reference server [--attention-backend TRITON_ATTN].
set -u
abspath() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
for v in MODELS OUT PROMPTS WORK; do
  [ -n "${!v:-}" ] && export "$v=$(abspath "${!v}")"
done
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}

MODELS=${MODELS:-${TINYPAIR_DIR:-$PWD/../shared/models/tinypair}}
TARGET=$MODELS/target
DRAFTER=$MODELS/drafter
PORT=${PORT:-8000}
OUT=${OUT:-${WORK:-/tmp/ddtree-bench}/serve_e2e}
N=${N:-64}
MAX_TOKENS=${MAX_TOKENS:-128}
BUDGET=${BUDGET:-64}
DEPTH=${DEPTH:-15}
START_TIMEOUT=${START_TIMEOUT:-200}
# The reference uses the Triton backend too (DDTree forces it on the target),
# so that both servers run the same attention kernels.
REF_ARGS=${REF_ARGS:---attention-backend TRITON_ATTN}
BASE=http://127.0.0.1:$PORT
PROMPTS=${PROMPTS:-$MODELS/prompts_heldout.jsonl}
mkdir -p "$OUT"
PROMPT_ARGS=()
[ -f "$PROMPTS" ] && PROMPT_ARGS=(--prompts "$PROMPTS")
SPEC="{\"method\":\"ddtree\",\"model\":\"$DRAFTER\",\"tree_budget\":$BUDGET,\"draft_depth\":$DEPTH}"
# --max-num-seqs: `vllm serve` defaults to 1024 sequences on an H200, and
# with 8192 batched tokens upstream's check of the drafting slots
# (1024 x (draft_depth - 1)) leaves none to schedule (DFlash fails the same way).
COMMON=(--host 127.0.0.1 --port "$PORT" --dtype float32 --max-model-len 2048
        --max-num-seqs "${MAX_NUM_SEQS:-128}"
        --gpu-memory-utilization "${GPU_UTIL:-0.9}"
        --served-model-name tinypair --chat-template bench/chat_template.jinja
        --uvicorn-log-level warning)
SERVER_PID=
T0=$(date +%s)
status_bad=0; status_ref=1; status_tree=1

stop_server() {
  [ -z "$SERVER_PID" ] && return
  kill "$SERVER_PID" 2>/dev/null
  for _ in $(seq 1 40); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
  kill -9 "$SERVER_PID" 2>/dev/null
  wait "$SERVER_PID" 2>/dev/null
  SERVER_PID=
}
trap stop_server EXIT

start_server() {  # $1: log name, then extra args
  local log=$OUT/$1.log; shift
  "$PYTHON" -m vllm.entrypoints.cli.main serve "$TARGET" "${COMMON[@]}" "$@" >"$log" 2>&1 &
  SERVER_PID=$!
  local deadline=$(( $(date +%s) + START_TIMEOUT ))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "server $log exited during startup:"; tail -30 "$log"; SERVER_PID=; return 1
    fi
    if curl -sf "$BASE/health" >/dev/null 2>&1 || "$PYTHON" - "$BASE" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + "/health", timeout=2)
PY
    then
      echo "server up after $(( $(date +%s) - T0 ))s since start of script ($log)"; return 0
    fi
    sleep 2
  done
  echo "server $log not healthy after ${START_TIMEOUT}s:"; tail -30 "$log"; return 1
}

echo "== 0. bad config: one line, non-zero exit"
BAD="{\"method\":\"ddtree\",\"model\":\"$DRAFTER\",\"tree_budget\":0}"
timeout 90 "$PYTHON" -m vllm.entrypoints.cli.main serve "$TARGET" --dtype float32 \
  --host 127.0.0.1 --port "$PORT" --speculative-config "$BAD" >"$OUT/bad.out" 2>"$OUT/bad.err"
rc=$?
last=$(grep -v '^\s*$' "$OUT/bad.err" | tail -1)
echo "exit $rc; last stderr line: $last"
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [[ "$last" == *"DDTree: tree_budget"* ]] \
   && ! grep -q Traceback "$OUT/bad.err"; then status_bad=0; else status_bad=1; fi

echo "== 1. no-spec reference server"
# shellcheck disable=SC2086
if start_server nospec $REF_ARGS; then
  "$PYTHON" bench/serve_load.py --base-url "$BASE" "${PROMPT_ARGS[@]}" --n "$N" \
    --concurrency "$N" --max-tokens "$MAX_TOKENS" --disconnect-fraction 0 \
    --save "$OUT/ref.json" | tee "$OUT/ref.result"
  status_ref=${PIPESTATUS[0]}
fi
stop_server

echo "== 2. DDTree server: $SPEC"
if [ "$status_ref" -eq 0 ] && start_server ddtree --speculative-config "$SPEC"; then
  "$PYTHON" bench/serve_load.py --base-url "$BASE" "${PROMPT_ARGS[@]}" --n "$N" \
    --concurrency "$N" --max-tokens "$MAX_TOKENS" --disconnect-fraction 0.25 \
    --reference "$OUT/ref.json" --expect-ddtree | tee "$OUT/ddtree.result"
  status_tree=${PIPESTATUS[0]}
  echo "-- DDTree lines of the server log:"
  grep -E "DDTree|SpecDecoding metrics" "$OUT/ddtree.log" | tail -5
fi
stop_server

ok=$(( status_bad == 0 && status_ref == 0 && status_tree == 0 ))
echo "E2E {\"ok\": $([ $ok = 1 ] && echo true || echo false), \"bad_config\": $status_bad, \"reference\": $status_ref, \"ddtree\": $status_tree, \"elapsed_s\": $(( $(date +%s) - T0 ))}"
[ $ok = 1 ]
