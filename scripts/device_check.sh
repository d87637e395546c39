#!/usr/bin/env bash
# The CUDA device check of issue 15, for the GPU machine (Python 3.12, CUDA torch, no vLLM, no cffi,
# no network). Run from the repository root with the cffi/pycparser wheels carried in .whl/:
#   bash scripts/device_check.sh            (results in $OUT: summary.json, bench.log, build.log)
# It installs the wheels, builds the native modules for this Python, then runs
# `python3 -m hpkv.bench.cuda` under a 420 s bound (the check itself needs about 2-3 minutes).
set -uo pipefail
OUT=${OUT:-/tmp/hpkv-device-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device_check: cannot install the carried wheels (.whl/)"; exit 3; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
# A 3.11 build from elsewhere would not load here: rebuild both native modules in place.
rm -f hpkv/_native*.so hpkv/_ringcall*.so
if ! python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    echo "device_check: building the native modules failed"
    exit 4
fi
# Pools live on tmpfs; a container's /dev/shm may be small (64 MiB in Docker): then mount our own.
SHM=/dev/shm
if [ "$(df -k --output=avail /dev/shm 2>/dev/null | tail -1)" -lt $((12 * 1024 * 1024)) ] 2>/dev/null; then
    mkdir -p /tmp/hpkv-shm && mount -t tmpfs -o size=16g tmpfs /tmp/hpkv-shm && SHM=/tmp/hpkv-shm
fi
df -h "$SHM"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.used \
    --format=csv >"$OUT/nvidia-smi.csv" 2>&1
cat "$OUT/nvidia-smi.csv"
timeout -k 10 420 python3 -m hpkv.bench.cuda --out "$OUT" --shm "$SHM"
rc=$?
echo "device_check: hpkv.bench.cuda exited with $rc"
head -c 6000 "$OUT/summary.json" 2>/dev/null
exit $rc
