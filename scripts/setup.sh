#!/usr/bin/env bash
# Installs what building and testing dcpmla needs on Debian 12: missing Debian
# packages (apt-get), then the pinned Python tools into a project-local .venv.
# Idempotent and quick when everything is present: it asks apt only when a
# package is missing, and pip only when requirements.txt changed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# Each line is used by the build: the toolchain; the Python module (nanobind) and its venv;
# the C++ tests (GoogleTest) and CPU benchmark (Google Benchmark); the CLI, bench binaries and
# the library (CLI11, nlohmann-json, fmt); the MPI communicator and its tests; `make fuzz`
# (clang with libFuzzer and the sanitizer runtimes).
PACKAGES=(
  build-essential cmake make git
  python3 python3-venv python3-dev
  libgtest-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev
  libopenmpi-dev openmpi-bin
  clang libclang-rt-14-dev
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done

if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=()
  if [[ "$(id -u)" != 0 ]]; then
    command -v sudo >/dev/null || { echo "setup: need root or sudo to install ${missing[*]}" >&2; exit 1; }
    SUDO=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${SUDO[@]}" apt-get update -q
  "${SUDO[@]}" apt-get install -y -q "${missing[@]}"
fi

# The venv uses whichever python3 is first on PATH (Debian's /usr/bin/python3 on a
# fresh machine). A venv whose interpreter vanished is rebuilt.
PY="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]] || ! .venv/bin/python -c 'import sys' >/dev/null 2>&1; then
  echo "setup: creating .venv with $("$PY" --version 2>&1)"
  rm -rf .venv
  "$PY" -m venv .venv
fi

stamp=.venv/.requirements.sha256
want="$(sha256sum requirements.txt | cut -d' ' -f1)"
if [[ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]]; then
  echo "setup: installing requirements.txt into .venv"
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
  echo "$want" > "$stamp"
fi
