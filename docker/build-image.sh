#!/usr/bin/env bash
# Build the rollout image with the engine's classic builder (no buildx needed).
#   docker/build-image.sh                 FROM python:3.12-slim, packages from PyPI
#   docker/build-image.sh --local-base    no registry, no PyPI in the build: a debootstrap base
#                                         (docker/build-base.sh) and a host-built wheelhouse
#                                         (docker/build-wheels.sh), also used as Redis image
#   --base IMAGE     another base image      --tag TAG   image tag (default rollout-worker:local)
# Prints the compose variables to use on stdout, e.g. `eval "$(docker/build-image.sh ...)"`:
#   ROLLOUT_IMAGE=...   and, with --local-base, ROLLOUT_REDIS_IMAGE=...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

base="python:3.12-slim"
tag="rollout-worker:local"
local_base=""
while (($#)); do
  case "$1" in
    --local-base) local_base=1 ;;
    --base) base="$2" && shift ;;
    --tag) tag="$2" && shift ;;
    *) echo "usage: $0 [--local-base] [--base IMAGE] [--tag TAG]" >&2 && exit 2 ;;
  esac
  shift
done

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
# A staged context: exactly what the Dockerfile copies, plus the wheelhouse when offline, so
# wheels never land in the work tree.
tar -cf - --exclude=__pycache__ --exclude='*.pyc' pyproject.toml README.md rollout_wire rollout_worker \
  trainer_stub docker/Dockerfile docker/wheels/README.md | tar -xf - -C "$ctx"
if [[ -n "$local_base" ]]; then
  base=$(./docker/build-base.sh)
  wheels=$(./docker/build-wheels.sh)
  image_python=$(docker run --rm "$base" python3 -c 'import sys; print(sys.version_info[:2])')
  host_python=$("${PYTHON:-python3}" -c 'import sys; print(sys.version_info[:2])')
  if [[ "$image_python" != "$host_python" ]]; then
    echo "build-image: base python $image_python != host python $host_python (wheels)" >&2
    exit 1
  fi
  cp -l "$wheels"/*.whl "$ctx/docker/wheels/" 2>/dev/null || cp "$wheels"/*.whl "$ctx/docker/wheels/"
fi

start=$SECONDS
echo "build-image: building $tag from $base" >&2
# The CLI falls back to the classic builder when buildx is absent; say so explicitly.
DOCKER_BUILDKIT=0 docker build -q --force-rm -f "$ctx/docker/Dockerfile" --build-arg "BASE_IMAGE=$base" \
  -t "$tag" "$ctx" >/dev/null
echo "build-image: built $tag in $((SECONDS - start))s" >&2
# Each source change leaves the previous build untagged: drop those, never anything else.
docker image prune -f --filter label=org.opencontainers.image.title=rollout-worker >/dev/null
echo "ROLLOUT_IMAGE=$tag"
[[ -z "$local_base" ]] || echo "ROLLOUT_REDIS_IMAGE=$base"
