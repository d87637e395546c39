#!/usr/bin/env bash
# The test command: sets up everything on a fresh machine (scripts/setup.sh,
# idempotent and quick when done before), the static checks (scripts/check.sh),
# then the whole test suite,
# real-vLLM tests included. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check.sh
exec .venv/bin/python -m pytest -ra --durations=15 "$@"
