#!/usr/bin/env bash
# The main job on a fresh machine: install, then run a batch of 10 sandboxed episodes through
# the real pipeline (a private redis-server and Celery workers are started and stopped for it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./hack/setup.sh
exec rollout run --count 10 --parallelism 10 --all-in-one "$@"
