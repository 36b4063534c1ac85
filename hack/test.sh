#!/usr/bin/env bash
# The whole test suite on a fresh machine: install, lint, type-check, start the local Kubernetes
# (built from source on first use, cached after), then run every test. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./hack/setup.sh --dev

ruff check rollout_worker trainer_stub tests
ruff format --check rollout_worker trainer_stub
mypy

if [[ -z "${KUBECONFIG:-}" ]]; then
  # Builds kube-apiserver & co. the first time (tens of minutes), then starts in seconds.
  ./hack/localkube/cluster.sh up
  eval "$(./hack/localkube/cluster.sh env)"
fi
exec python3 -m pytest "$@"
