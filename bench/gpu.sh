#!/usr/bin/env bash
# GPU checks and benchmarks in one go: bash bench/gpu.sh OUTDIR
#
# Needs only this working tree and a Python with torch (a CUDA build), transformers
# and the engine's pure-Python deps; installs nothing and touches no network
# (HF_HUB_OFFLINE=1). Fits in 8 minutes on one H200:
#   1. the CUDA tests (pytest -m cuda: captured CUDA-graph path, exact vs gamma 0 and HF generate)
#   2. specvoice bench engine, Qwen2.5-7B / 0.5B shapes, bf16, random weights, CUDA graphs
#      (a = 0.6 0.8 0.9, gamma 1..8)             -> OUTDIR/engine.json
#   3. the same at a = 0.8 without CUDA graphs  -> OUTDIR/engine-eager.json (what capture buys)
#   4. specvoice bench llm --device cuda --dtype bfloat16, only when the config's model
#      files are present locally                -> OUTDIR/bench-llm.json
# Logs of every step go to OUTDIR/*.log; OUTDIR/summary.txt says what ran and how it ended.
set -u
OUT="${1:?usage: bash bench/gpu.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
T0=$(date +%s)

# ---- 0. what this Python has ------------------------------------------------------------
"$PY" - > "$OUT/env.txt" 2>&1 <<'EOF'
import importlib, sys
need = ["torch", "transformers", "tokenizers", "safetensors", "numpy", "tqdm", "pytest"]
missing = []
for name in need:
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as exc:  # noqa: BLE001
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
if missing:
    print("MISSING: " + "; ".join(missing))
    sys.exit(3)
import torch
print(f"torch.version.cuda {torch.version.cuda}; cuda available {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    print("MISSING: a CUDA GPU visible to torch (CPU-only torch build, or no device)")
    sys.exit(4)
print("gpu", torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF
rc=$?
cat "$OUT/env.txt"
if [ $rc -ne 0 ]; then
    note "environment: NOT READY ($(grep MISSING "$OUT/env.txt")); nothing installed, nothing run"
    exit $rc
fi
note "environment: ok ($(grep '^gpu' "$OUT/env.txt"))"

step() {  # step NAME SECONDS CMD...: run with a time limit, log, record the outcome
    local name="$1" limit="$2"; shift 2
    local t=$(date +%s)
    timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local what="rc=$rc"
    [ $rc -eq 124 ] && what="TIMED OUT after ${limit}s"
    note "$name: $what ($(( $(date +%s) - t )) s; log $name.log)"
    tail -n 40 "$OUT/$name.log"
    return $rc
}

BENCH_ENGINE=("$PY" -c 'import argparse, sys
from bench import engine as b
p = argparse.ArgumentParser(); b.add_arguments(p)
sys.exit(b.run(p.parse_args(sys.argv[1:])))')

# ---- 1. CUDA tests ------------------------------------------------------------------------
step cuda-tests 150 "$PY" -m pytest tests/test_engine_static.py -m cuda -q -p no:cacheprovider -p no:warnings \
    -o addopts="" -rA

# ---- 2. controlled acceptance, 7B / 0.5B shapes, CUDA graphs -----------------------------
step bench-engine 220 "${BENCH_ENGINE[@]}" --shapes 7b-0.5b --device cuda --dtype bfloat16 \
    --acceptance 0.6 0.8 0.9 --gammas 1 2 3 4 5 6 7 8 --new-tokens 256 --prompt-tokens 256 --repeats 2 \
    --out "$OUT/engine.json"

# ---- 3. the same without CUDA graphs (a = 0.8, a few gammas) -----------------------------
step bench-engine-eager 90 "${BENCH_ENGINE[@]}" --shapes 7b-0.5b --device cuda --dtype bfloat16 \
    --acceptance 0.8 --gammas 4 8 --new-tokens 128 --prompt-tokens 256 --no-cuda-graphs --no-hf \
    --out "$OUT/engine-eager.json"

# ---- 4. bench llm on real models, only when their files are here -------------------------
LEFT=$(( 470 - ($(date +%s) - T0) ))
if "$PY" - > "$OUT/bench-llm-models.txt" 2>&1 <<'EOF'
import sys
from pathlib import Path
from pipeline.config import load_config
from modelstore import resolve_model
cfg = load_config(None).llm
try:
    paths = [resolve_model(cfg.target), resolve_model(cfg.draft)]
except Exception as exc:  # noqa: BLE001
    print(f"models not present: {exc}")
    sys.exit(1)
missing = [p for p in paths if not Path(p).exists()]
print("models:", paths, "missing:", missing)
sys.exit(1 if missing else 0)
EOF
then
    if [ "$LEFT" -gt 60 ]; then
        step bench-llm $(( LEFT - 10 )) "$PY" -m demo.cli bench llm --device cuda --dtype bfloat16 --hf-dtype bfloat16 \
            --turns 8 --out "$OUT/bench-llm.json"
    else
        note "bench-llm: skipped, only ${LEFT}s of the 8-minute budget left"
    fi
else
    note "bench-llm: skipped ($(tail -n 1 "$OUT/bench-llm-models.txt"))"
fi
note "total: $(( $(date +%s) - T0 )) s; results in $OUT"
