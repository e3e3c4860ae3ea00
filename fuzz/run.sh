#!/usr/bin/env bash
# Coverage-guided fuzzing of the Twilio protocol parser.
#   bash fuzz/run.sh [SECONDS]      (default 600; installs atheris if missing)
# The corpus grows in fuzz/corpus (git-ignored by convention: not committed); crashes land in
# fuzz/artifacts/. Exit status non-zero means a crash was found: the reproducer is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN="${1:-600}"
PY="${PYTHON:-python}"
if ! "$PY" -c "import atheris" 2>/dev/null; then
  "$PY" -m pip install --quiet 'atheris>=2.3'
fi
mkdir -p fuzz/corpus fuzz/artifacts
cp -n fuzz/seeds/* fuzz/corpus/ 2>/dev/null || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" fuzz/fuzz_protocol.py -max_total_time="$SECONDS_TO_RUN" -timeout=5 -rss_limit_mb=2048 \
  -max_len=4096 -print_final_stats=1 -artifact_prefix=fuzz/artifacts/ fuzz/corpus
