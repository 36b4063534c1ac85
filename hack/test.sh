#!/usr/bin/env bash
# The whole test suite on a fresh machine: install, lint, type-check, start the local Kubernetes
# (built from source on first use, cached after), then run every test. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./hack/setup.sh --dev

ruff check rollout_worker trainer_stub tests benchmarks
ruff format --check rollout_worker trainer_stub
mypy

if [[ -z "${KUBECONFIG:-}" ]]; then
  # Builds kube-apiserver & co. the first time (minutes), then starts in seconds; stopped on
  # exit when this script started it.
  if ! ./hack/localkube/cluster.sh status >/dev/null 2>&1; then
    trap './hack/localkube/cluster.sh down >/dev/null 2>&1 || true' EXIT
  fi
  ./hack/localkube/cluster.sh up
  # One real node (kubelet + containerd, images built locally) for Pods that really run.
  ./hack/localkube/cluster.sh node-up
  eval "$(./hack/localkube/cluster.sh env)"
fi
python3 -m pytest "$@"
