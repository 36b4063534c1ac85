#!/usr/bin/env bash
# The whole test suite on a fresh machine: install (into the project's .venv, hack/setup.sh),
# lint, type-check, build the docs site, start the local Kubernetes (built from source on first
# use, cached after) and its real node, then run every test. Extra args go to pytest.
# ruff, mypy, pytest and `rollout` all come from the venv (first on PATH for the tests too).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Wall time per phase, printed on stderr as `test.sh: PHASE Ns` (the cold path's budget).
t=${SECONDS}
phase() { echo "test.sh: $1 $((SECONDS - t))s" >&2; t=${SECONDS}; }
./hack/setup.sh --dev --train
# The released trainer libraries the adapters are tested against (marker train), beside .venv.
./hack/trainer-libs.sh
phase setup
VENV="${ROLLOUT_VENV:-.venv}"
[[ "${VENV}" == /* ]] || VENV="$(pwd)/${VENV}"
export VIRTUAL_ENV="${VENV}" PATH="${VENV}/bin:${PATH}"
hash -r

ruff check rollout_wire rollout_worker trainer_stub tests benchmarks
ruff format --check rollout_wire rollout_worker trainer_stub
mypy
phase lint+types

# The docs site, warnings as errors (a broken link or anchor, a page missing from the nav, a
# docstring the API reference cannot read), built into a temporary folder.
site="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "${site}"
rm -rf "${site}"
phase docs

if [[ -z "${KUBECONFIG:-}" ]]; then
  # Builds kube-apiserver & co. the first time (minutes), then starts in seconds; stopped on
  # exit when this script started it.
  if ! ./hack/localkube/cluster.sh status >/dev/null 2>&1; then
    trap './hack/localkube/cluster.sh down >/dev/null 2>&1 || true' EXIT
  fi
  ./hack/localkube/cluster.sh up
  phase cluster
  # One real node (kubelet + containerd, images built locally) for Pods that really run.
  ./hack/localkube/cluster.sh node-up
  phase real-node
  eval "$(./hack/localkube/cluster.sh env)"
fi
rc=0
"${VENV}/bin/python" -m pytest "$@" || rc=$?
phase pytest
exit "${rc}"
