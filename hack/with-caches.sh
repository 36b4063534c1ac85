#!/usr/bin/env bash
# Run a command with every cache the scripts use relocated under one directory, e.g. to prove
# the cold path on a machine whose default caches are warm (or in use by a running cluster):
#
#   hack/with-caches.sh /tmp/cold ./hack/test.sh            # or: ... bash .ci/run
#
# Sets (each only when not already set):
#   ROLLOUT_LOCALKUBE_CACHE  DIR/localkube  binaries, cluster state, kubeconfig, node configs
#   ROLLOUT_LOCALKUBE_IMAGES DIR/localkube/images   the real node's image tarballs
#   GOMODCACHE, GOCACHE      DIR/gomod, DIR/gocache  Go modules and build cache
#   ROLLOUT_DOCKER_CACHE     DIR/docker     compose binary, base rootfs and wheelhouse
#   ROLLOUT_DOCKER_DATA_ROOT DIR/docker-data (used only if this run starts dockerd)
#   PIP_CACHE_DIR            DIR/pip
#   ROLLOUT_TRAINER_LIBS     DIR/trainer-libs   verl and skyrl (hack/trainer-libs.sh)
#   ROLLOUT_LOCALKUBE_NODE_ID 1             the real node's machine-wide names (bridge, ports,
#                                           containerd/kubelet dirs) differ from the default one
# The project's venv is the clone's own .venv (ROLLOUT_VENV to move it).
set -euo pipefail
dir="${1:?usage: hack/with-caches.sh DIR COMMAND [ARG...]}"
shift
(($#)) || { echo "usage: hack/with-caches.sh DIR COMMAND [ARG...]" >&2; exit 2; }
mkdir -p "${dir}"
dir="$(cd "${dir}" && pwd)"
export ROLLOUT_LOCALKUBE_CACHE="${ROLLOUT_LOCALKUBE_CACHE:-${dir}/localkube}"
export ROLLOUT_LOCALKUBE_IMAGES="${ROLLOUT_LOCALKUBE_IMAGES:-${ROLLOUT_LOCALKUBE_CACHE}/images}"
export GOMODCACHE="${GOMODCACHE:-${dir}/gomod}"
export GOCACHE="${GOCACHE:-${dir}/gocache}"
export ROLLOUT_DOCKER_CACHE="${ROLLOUT_DOCKER_CACHE:-${dir}/docker}"
export ROLLOUT_DOCKER_DATA_ROOT="${ROLLOUT_DOCKER_DATA_ROOT:-${dir}/docker-data}"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-${dir}/pip}"
export ROLLOUT_TRAINER_LIBS="${ROLLOUT_TRAINER_LIBS:-${dir}/trainer-libs}"
export ROLLOUT_LOCALKUBE_NODE_ID="${ROLLOUT_LOCALKUBE_NODE_ID:-1}"
exec "$@"
