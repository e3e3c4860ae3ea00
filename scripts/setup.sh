#!/usr/bin/env bash
# Set-up on a fresh Debian machine; sourced by scripts/demo.sh and scripts/test.sh.
#
# What it installs, and where:
# - Debian packages, system-wide (apt-get, as root or with sudo), only those missing:
#   libsndfile1 and libportaudio2 (audio I/O), mosquitto (the MQTT broker the tests
#   start on loopback), chromium + chromium-driver (the report page's browser tests),
#   espeak-ng (a second voice for the spoken test lines); for the tests only
#   (SPECVOICE_SETUP_TESTS=1, set by scripts/test.sh), postgresql-15 (the server binaries
#   and `postgres` user the booking store's tests start a throw-away server with).
# - Python packages into a virtual environment: the active one if any ($VIRTUAL_ENV),
#   else ./.venv in the checkout (created here): CPU torch first (`pip install
#   torch==2.13.0`; a bare `torch` would pull a multi-GB CUDA build), then this project,
#   editable, with its test extras (`pip install -e '.[test]'`: pytest, hypothesis, jiwer,
#   psycopg, and xllamacpp, the llama.cpp server the OpenAI backend is tested against),
#   then `pip check`.
# Models are not installed here: `specvoice models pull` puts them in $SPECVOICE_HOME
# (default ~/.cache/specvoice).
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

_sudo=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null; then _sudo="sudo"; fi
_need_apt=()
command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || _need_apt+=(mosquitto)
command -v chromium >/dev/null || _need_apt+=(chromium chromium-driver)
command -v espeak-ng >/dev/null || _need_apt+=(espeak-ng)
ldconfig -p 2>/dev/null | grep -q libsndfile || _need_apt+=(libsndfile1)
ldconfig -p 2>/dev/null | grep -q libportaudio || _need_apt+=(libportaudio2)
if [ "${SPECVOICE_SETUP_TESTS:-0}" = "1" ] && ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
  _need_apt+=(postgresql-15)
fi
if [ ${#_need_apt[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] apt-get install ${_need_apt[*]} (system packages)"
  $_sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $_sudo apt-get install -y -qq "${_need_apt[@]}" >/dev/null
fi

if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x "$_root/.venv/bin/python" ]; then
    echo "[setup] creating the virtual environment $_root/.venv"
    "${PYTHON:-python3}" -m venv "$_root/.venv"
  fi
  # shellcheck disable=SC1091
  . "$_root/.venv/bin/activate"
fi
echo "[setup] Python packages into $VIRTUAL_ENV"
# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e "$_root[test]"
python -m pip check
