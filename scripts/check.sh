#!/usr/bin/env bash
# Static checks, run by scripts/test.sh before pytest (zero findings expected):
#   ruff (rules in pyproject.toml), ruff format, mypy on the package, clang-format on native/.
# `bash scripts/check.sh --fix` applies what the formatters and ruff can fix.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
if [ "${1:-}" = "--fix" ]; then
  "$BIN/ruff" format hpkv tests
  "$BIN/ruff" check --fix hpkv tests
  "$BIN/clang-format" -i native/*.c native/*.h native/python/*.c
  exit 0
fi
echo "[check] ruff";          "$BIN/ruff" check --quiet hpkv tests
echo "[check] ruff format";   "$BIN/ruff" format --check --quiet hpkv tests
echo "[check] clang-format";  "$BIN/clang-format" --dry-run --Werror native/*.c native/*.h native/python/*.c
echo "[check] mypy";          "$BIN/mypy" --no-error-summary
echo "[check] all clean"
