#!/usr/bin/env bash
# The test command: set-up (scripts/setup.sh), the embedded models the tests use, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
# Voice models and the LLM pair (verified by SHA-256, converted once, cached in $SPECVOICE_HOME).
specvoice models pull
export SPECVOICE_REQUIRE_MODELS=1
set +e
python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is not a pass.
if [ $rc -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit $rc
