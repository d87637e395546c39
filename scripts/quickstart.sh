#!/usr/bin/env bash
# CT-HPKV's quick start by hand, as a user runs it: a pristine HOME, no HPKV_* variables,
# no config file, CT-HPKV's command line and prompts, Ctrl-C of vLLM, `hpkv stop` and a
# restart.
# Prints the TTFT of every request per phase (cold, GPU prefix hit, DRAM hit, storage hit
# after the restart) and hpkv's hit counters. Run after `bash scripts/setup.sh`.
#
#   bash scripts/quickstart.sh [PROMPTS] [MODEL]
#
# PROMPTS: how many 8192-token prompts (letters A, B, ...; default 4, CT-HPKV's number).
# MODEL:   default: the generated model with Qwen2.5-7B's KV shape (56 KiB per token).
# A cold 8192-token prefill takes 1-2 minutes per prompt on a 2-core AVX2 machine.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-4}
PY=$PWD/.venv/bin/python
MODEL=${2:-$($PY -c 'from hpkv.bench.ttft import SHAPES; from hpkv.testing.model import generate_model; print(generate_model(**SHAPES["qwen2.5-7b"]))')}
PORT=${PORT:-8000}
for v in $(env | grep -o '^HPKV_[A-Z_]*' || true); do unset "$v"; done
HOME=$(mktemp -d /tmp/hpkv-quickstart-home.XXXXXX)
export HOME VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
LOG=$HOME/vllm.log
PGID=

start_vllm() {
    setsid env VLLM_SERVER_DEV_MODE=1 "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
        --port "$PORT" --host 127.0.0.1 \
        --kv-transfer-config '{"kv_connector":"HpkvConnectorV1","kv_role":"kv_both"}' >>"$LOG" 2>&1 &
    PGID=$!
    local t0=$SECONDS
    until curl -sf "127.0.0.1:$PORT/health" >/dev/null; do
        kill -0 "$PGID" 2>/dev/null || { tail -30 "$LOG"; echo "vLLM exited" >&2; exit 1; }
        sleep 0.5
    done
    echo "vLLM ready after $((SECONDS - t0)) s"
}

stop_vllm() {  # Ctrl-C, as a user stops it
    [ -n "$PGID" ] || return 0
    kill -INT -- "-$PGID" 2>/dev/null || true
    for _ in $(seq 1 120); do kill -0 "$PGID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$PGID" 2>/dev/null || true
    PGID=
}
trap 'stop_vllm; "$PY" -m hpkv stop >/dev/null 2>&1 || true' EXIT

phase() {
    local name=$1 letter line
    printf '%-12s' "$name"
    for i in $(seq 0 $((N - 1))); do
        letter=$(printf "\\x$(printf %x $((65 + i)))")
        line=$(curl -s -o "$HOME/out-$name-$letter.json" -w '%{time_total}' "127.0.0.1:$PORT/v1/completions" \
            -H 'Content-Type: application/json' \
            -d '{"model": "'"$MODEL"'", "prompt": "'"$(printf "${letter} %.0s" $(seq 1 8192))"'", "max_tokens": 1, "temperature": 0}')
        printf ' %s=%ss' "$letter" "$line"
    done
    echo
}

start_vllm
phase cold
phase gpu
curl -sf -X POST "127.0.0.1:$PORT/reset_prefix_cache" >/dev/null
phase dram
stop_vllm
"$PY" -m hpkv stop  # the server outlives vLLM: without this the restarted vLLM hits DRAM
start_vllm
phase storage
for i in $(seq 0 $((N - 1))); do
    letter=$(printf "\\x$(printf %x $((65 + i)))")
    for p in gpu dram storage; do
        cmp -s <("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["text"])' "$HOME/out-cold-$letter.json") \
            <("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["text"])' "$HOME/out-$p-$letter.json") \
            || echo "output of $letter in phase $p differs from the cold one" >&2
    done
done
"$PY" -m hpkv status | sed -n '/^NAMESPACE/,/^$/p' || true
echo "\"cannot reach the hpkv server\" lines in vLLM log: $(grep -c "cannot reach the hpkv server" "$LOG" || true)"
echo "logs: $LOG and the pool directory's server.log"
