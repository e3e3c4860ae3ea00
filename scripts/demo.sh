#!/usr/bin/env bash
# The main job: set-up, the embedded default models, then a simulated phone call.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
specvoice models pull
specvoice call "$@"
