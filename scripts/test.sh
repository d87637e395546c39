#!/usr/bin/env bash
# The test command: sets up everything on a fresh machine (scripts/setup.sh,
# idempotent and quick when done before), the static checks (scripts/check.sh),
# then the whole test suite,
# real-vLLM tests included. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check.sh
# Two workers, a whole module on each (its shared engine with it): an engine start is mostly
# one process importing and compiling on one CPU, so two of them overlap on a 2-CPU machine
# (docs/development.md). HPKV_TEST_WORKERS=0 runs everything in this process.
workers=${HPKV_TEST_WORKERS:-2}
parallel=()
[ "$workers" = 0 ] || parallel=(-n "$workers" --dist loadfile)
exec .venv/bin/python -m pytest -ra --durations=15 "${parallel[@]}" "$@"
