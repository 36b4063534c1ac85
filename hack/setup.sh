#!/usr/bin/env bash
# Install what the project needs on a fresh Debian machine (idempotent, quiet when done already):
# redis-server and bubblewrap from apt, the package (+ dev tools with --dev) from PyPI.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v bwrap >/dev/null || need+=(bubblewrap)
if ((${#need[@]})); then
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  echo "setup: apt-get install ${need[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
# The local sandboxes run the system's Python (Debian's python3) as uid 1000.
[[ -x /usr/bin/python3 ]] || { echo "setup: /usr/bin/python3 is missing" >&2; exit 1; }

PYTHON="${PYTHON:-python3}"
extra=""
[[ "${1:-}" == "--dev" ]] && extra="[dev]"
if ! "$PYTHON" -c "import rollout_worker, trainer_stub" 2>/dev/null || [[ -n "$extra" ]]; then
  echo "setup: pip install -e .${extra}" >&2
  "$PYTHON" -m pip install -q --disable-pip-version-check --root-user-action=ignore -e ".${extra}"
fi
