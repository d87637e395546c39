#!/usr/bin/env bash
# Optional set-up for `hpkv bench peers`: installs LMCache 0.5.6 into its own environment,
# ~/.cache/hpkv/peers/lmcache (HPKV_PEERS_DIR overrides ~/.cache/hpkv/peers), never into the
# project's .venv. That environment is a venv whose site-packages also sees the project's
# (a .pth file), so vLLM and torch are the very same as hpkv's; only LMCache (--no-deps: its
# metadata hard-requires CUDA packages its CPU path never imports) and aiofiles are installed
# there. Telemetry off (LMCACHE_TRACK_USAGE=false, DO_NOT_TRACK=1). Remove the directory to
# uninstall. The same as `hpkv bench peers --setup`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m hpkv bench peers --setup
