#!/usr/bin/env bash
# The test command: sets up everything on a fresh machine (scripts/setup.sh,
# idempotent and quick when done before), the static checks (scripts/check.sh),
# then the whole test suite,
# real-vLLM tests included. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check.sh
# One process by default. HPKV_TEST_WORKERS=N runs the modules on N pytest-xdist workers, a
# whole module on each (its shared engine with it), then the tests marked `alone` (they measure
# the kernel's scheduling next to CPUs they keep busy) by themselves: about 21-26 minutes instead
# of 39 here, but not yet the default (docs/development.md says why). Extra arguments go to both
# phases.
workers=${HPKV_TEST_WORKERS:-0}
pytest=(.venv/bin/python -m pytest -ra --durations=15)
[ "$workers" != 0 ] || exec "${pytest[@]}" "$@"
status=0
HPKV_TEST_PHASE=parallel "${pytest[@]}" -n "$workers" --dist loadfile "$@" || status=$?
alone=0
HPKV_TEST_PHASE=alone "${pytest[@]}" "$@" || alone=$?
# pytest's 5: no test selected in that phase (a -k or a path may select only one kind)
if [ "$status" = 5 ]; then status=$alone; elif [ "$status" = 0 ] && [ "$alone" != 5 ]; then status=$alone; fi
exit "$status"
