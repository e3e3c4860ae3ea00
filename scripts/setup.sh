#!/usr/bin/env bash
# Installs everything specvoice needs on a fresh Debian machine (as root or with sudo):
# system packages for the tests, CPU torch, then the project itself (editable) with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null; then SUDO="sudo"; fi
need_apt=()
command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || need_apt+=(mosquitto)
command -v chromium >/dev/null || need_apt+=(chromium chromium-driver)
ldconfig -p 2>/dev/null | grep -q libsndfile || need_apt+=(libsndfile1)
ldconfig -p 2>/dev/null | grep -q libportaudio || need_apt+=(libportaudio2)
if [ ${#need_apt[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] apt-get install ${need_apt[*]}"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e '.[test]'
