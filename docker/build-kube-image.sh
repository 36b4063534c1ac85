#!/usr/bin/env bash
# Build the Kubernetes worker image (docker/Dockerfile.kube) without any registry or PyPI in the
# build, the way the project builds its other images, and optionally load it (and a Redis image)
# into the local real node's containerd:
#
#   docker/build-kube-image.sh            build rollout.local/rollout-worker:kube and the
#                                         sandbox-host image rollout.local/rollout-worker:host
#   docker/build-kube-image.sh --import   ... and import them and rollout.local/redis:bookworm
#                                         into the real node's containerd (hack/localkube node-up)
#   --tag TAG    worker image tag (default rollout.local/rollout-worker:kube)
#
# Inputs, all local and cached: the debootstrap base (docker/build-base.sh: python3 + venv, used
# only to build the venv; it also holds redis-server and becomes the Redis image), the host-built
# wheelhouse (docker/build-wheels.sh), and the node's minbase python image
# (hack/images/build.sh python), which the final stage runs on: no bubblewrap (removed: the
# base has it for host Pods), no compilers; the host stage keeps bubblewrap.
# Needs a Docker engine (hack/docker-up.sh). Prints `ROLLOUT_KUBE_IMAGE=...` and
# `ROLLOUT_KUBE_REDIS_IMAGE=...` on stdout; progress on stderr. Image tarballs for the node go
# to ${ROLLOUT_LOCALKUBE_IMAGES:-${ROLLOUT_LOCALKUBE_CACHE:-/var/cache/rollout-localkube}/images}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

tag="rollout.local/rollout-worker:kube"
host_tag="rollout.local/rollout-worker:host"
redis_tag="rollout.local/redis:bookworm"
import=""
while (($#)); do
  case "$1" in
    --import) import=1 ;;
    --tag) tag="$2" && shift ;;
    *) echo "usage: $0 [--import] [--tag TAG]" >&2 && exit 2 ;;
  esac
  shift
done
say() { echo "build-kube-image: $*" >&2; }

cache="${ROLLOUT_LOCALKUBE_IMAGES:-${ROLLOUT_LOCALKUBE_CACHE:-/var/cache/rollout-localkube}/images}"
mkdir -p "$cache"
exec 9>"$cache/.kube-image.lock"
flock 9

base=$(./docker/build-base.sh)
wheels=$(./docker/build-wheels.sh)
read -r runtime runtime_tar < <(hack/images/build.sh python)
if ! docker image inspect "$runtime" >/dev/null 2>&1; then
  say "docker load $runtime_tar"
  docker load -q -i "$runtime_tar" >/dev/null
fi

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
tar -cf - --exclude=__pycache__ --exclude='*.pyc' pyproject.toml rollout_wire \
  rollout_worker trainer_stub docker/Dockerfile.kube docker/wheels/README.md | tar -xf - -C "$ctx"
# Copies, not hard links: the timestamps below must not touch the shared wheelhouse.
cp "$wheels"/*.whl "$ctx/docker/wheels/"

# Same inputs, same image: fixed timestamps (the classic builder's COPY cache sees them) and a
# content key over the staged context and both bases; a warm call builds nothing.
find "$ctx" -exec touch -h -d @0 {} +
key=$( (tar -C "$ctx" --sort=name --owner=0 --group=0 --numeric-owner -cf - . ; \
  echo "$base $(docker image inspect -f '{{.Id}}' "$runtime")") | sha256sum | cut -c1-16)
labelled() { docker image inspect -f '{{index .Config.Labels "rollout.content-key"}}' "$1" 2>/dev/null; }
if [[ "$(labelled "$tag")" == "$key" && "$(labelled "$host_tag")" == "$key" ]]; then
  say "$tag and $host_tag are up to date (content key $key)"
else
  start=$SECONDS
  say "building $tag (venv built on $base, runs on $runtime)"
  DOCKER_BUILDKIT=0 docker build -q --force-rm -f "$ctx/docker/Dockerfile.kube" \
    --build-arg "BASE_IMAGE=$base" --build-arg "RUNTIME_IMAGE=$runtime" \
    --label "rollout.content-key=$key" -t "$tag" "$ctx" >/dev/null
  # The sandbox-host stage: the classic builder built it on the way (cached layers).
  DOCKER_BUILDKIT=0 docker build -q --force-rm -f "$ctx/docker/Dockerfile.kube" --target host \
    --build-arg "BASE_IMAGE=$base" --build-arg "RUNTIME_IMAGE=$runtime" \
    --label "rollout.content-key=$key" -t "$host_tag" "$ctx" >/dev/null
  say "built $tag in $((SECONDS - start))s ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%d MB", $1/1e6}'))"
  docker image prune -f --filter label=org.opencontainers.image.title=rollout-worker-kube >/dev/null
fi
docker tag "$base" "$redis_tag"

if [[ -n "$import" ]]; then
  # The node's containerd (hack/localkube/node.sh); never Docker's or the system's. A node with
  # ROLLOUT_LOCALKUBE_NODE_ID=N (N > 0, as hack/with-caches.sh sets) has its own, suffixed -N.
  node_id="${ROLLOUT_LOCALKUBE_NODE_ID:-0}"
  suffix=""
  [[ "${node_id}" == 0 ]] || suffix="-${node_id}"
  sock="${ROLLOUT_NODE_CONTAINERD_STATE:-/run/rollout-containerd2${suffix}}/containerd.sock"
  [[ -S "$sock" ]] || { say "no node containerd at $sock (hack/localkube/cluster.sh node-up)"; exit 1; }
  # The node's own ctr (hack/localkube/build.sh builds it with its containerd), else PATH's.
  ctr_bin="$(ls "${ROLLOUT_LOCALKUBE_CACHE:-/var/cache/rollout-localkube}"/v*/bin/ctr 2>/dev/null \
    | tail -n 1)"
  [[ -n "$ctr_bin" ]] || ctr_bin=ctr
  for image in "$tag" "$host_tag" "$redis_tag"; do
    id=$(docker image inspect -f '{{.Id}}' "$image" | cut -c8-19)
    tarball="$cache/$(tr '/:' '__' <<<"$image")-$id.tar"
    if [[ ! -s "$tarball" ]]; then
      docker save -o "$tarball.tmp" "$image"
      mv -f "$tarball.tmp" "$tarball"
      find "$cache" -maxdepth 1 -name "$(tr '/:' '__' <<<"$image")-*.tar" ! -path "$tarball" -delete
    fi
    # Importing what containerd already holds only re-tags it (a few seconds).
    say "ctr import $tarball"
    "$ctr_bin" --address "$sock" -n k8s.io images import "$tarball" >/dev/null
    # Pinned, so a low disk never makes the kubelet delete it (hack/localkube/node.sh: pin_image).
    "$ctr_bin" --address "$sock" -n k8s.io images label "$image" \
      io.cri-containerd.pinned=pinned >/dev/null
  done
fi
echo "ROLLOUT_KUBE_IMAGE=$tag"
echo "ROLLOUT_KUBE_HOST_IMAGE=$host_tag"
echo "ROLLOUT_KUBE_REDIS_IMAGE=$redis_tag"
