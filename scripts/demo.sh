#!/usr/bin/env bash
# The demo: sets up everything on a fresh machine (scripts/setup.sh), generates the
# model (Qwen2.5-7B's KV shape) and runs CT-HPKV's four-tier TTFT experiment against real vLLM
# with hpkv (hpkv bench ttft), printing the table. Extra arguments go to the bench,
# e.g. `bash scripts/demo.sh --requests 10` for the full experiment.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hpkv bench ttft --shape qwen2.5-7b --tokens 8192 --requests 1 --top-frame "$@"
