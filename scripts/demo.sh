#!/usr/bin/env bash
# The main job: set-up (scripts/setup.sh), the embedded default models, then a simulated phone call.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
specvoice models pull
specvoice call "$@"
