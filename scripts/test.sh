#!/usr/bin/env bash
# The test command: set-up (scripts/setup.sh), the embedded models the tests use, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
export SPECVOICE_SETUP_TESTS=1   # set-up adds what only the tests need (PostgreSQL's server binaries)
source scripts/setup.sh
# Voice models and the LLM pair (verified by SHA-256, converted once, cached in $SPECVOICE_HOME).
specvoice models pull
# What set-up installed must be there: a missing model, llama.cpp server or PostgreSQL fails, not skips.
export SPECVOICE_REQUIRE_MODELS=1 SPECVOICE_REQUIRE_ENGINE=1 SPECVOICE_REQUIRE_POSTGRES=1
set +e
python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is not a pass.
if [ $rc -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit $rc
