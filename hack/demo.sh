#!/usr/bin/env bash
# The main job on a fresh machine: install (into the project's .venv, hack/setup.sh), then run a
# batch of 10 sandboxed episodes through the real pipeline (a private redis-server and Celery
# workers are started and stopped for it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./hack/setup.sh
VENV="${ROLLOUT_VENV:-.venv}"
exec "${VENV}/bin/rollout" run --count 10 --parallelism 10 --all-in-one "$@"
