#!/usr/bin/env bash
# The test command: sets up everything on a fresh machine (scripts/setup.sh,
# idempotent and quick when done before), the static checks (scripts/check.sh),
# then the whole test suite,
# real-vLLM tests included. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check.sh
# The modules run on two pytest-xdist workers, a whole module on each (its shared engine with
# it), then the tests marked `alone` (they measure the kernel's scheduling next to CPUs they
# keep busy, or wait on a timer) by themselves: about 30 minutes instead of 39 here.
# An engine start is mostly one process importing and compiling on one CPU, so two overlap
# even on two CPUs. HPKV_TEST_WORKERS=N sets the workers, 0 runs everything in this process
# (the default on one CPU). Extra arguments go to both phases.
workers=${HPKV_TEST_WORKERS:-$([ "$(nproc)" -ge 2 ] && echo 2 || echo 0)}
pytest=(.venv/bin/python -m pytest -ra --durations=15)
[ "$workers" != 0 ] || exec "${pytest[@]}" "$@"
status=0
HPKV_TEST_PHASE=parallel "${pytest[@]}" -n "$workers" --dist loadfile "$@" || status=$?
alone=0
HPKV_TEST_PHASE=alone "${pytest[@]}" "$@" || alone=$?
# pytest's 5: no test selected in that phase (a -k or a path may select only one kind)
if [ "$status" = 5 ]; then status=$alone; elif [ "$status" = 0 ] && [ "$alone" != 5 ]; then status=$alone; fi
exit "$status"
