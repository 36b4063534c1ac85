#!/usr/bin/env bash
# Build a local Debian bookworm base image (python3 + venv, bubblewrap) without any container
# registry: debootstrap a rootfs from Debian's archive and `docker import` it.
# Prints the image tag on stdout. Idempotent and cached by a content key (this script's text
# and the package list): the rootfs tarball stays in $ROLLOUT_DOCKER_CACHE, the image in the
# engine, so a warm call is a no-op and a new engine only re-imports the tarball.
set -euo pipefail

CACHE="${ROLLOUT_DOCKER_CACHE:-/var/cache/rollout-docker}"
SUITE=bookworm
# Where the packages come from: ROLLOUT_DEBIAN_MIRROR, else this machine's apt source for the
# suite (hack/debian-mirror.sh). Not part of the cache key (same packages from any mirror).
MIRROR=""
# What the worker image needs from Debian: the sandbox interpreter at /usr/bin/python3, venv
# for the project's own environment, bubblewrap for episode isolation, CA certificates; and
# redis-server, so the same image stands in for the Redis image when no registry is reachable.
PACKAGES=python3,python3-venv,bubblewrap,ca-certificates,redis-server

say() { echo "build-base: $*" >&2; }

key=$( (cat "${BASH_SOURCE[0]}"; echo "$SUITE $PACKAGES") | sha256sum | cut -c1-12)
tag="rollout-base:$SUITE-$key"
tarball="$CACHE/base-$SUITE-$key.tar"

if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "$tag"
  exit 0
fi

mkdir -p "$CACHE"
if [[ ! -s "$tarball" ]]; then
  command -v debootstrap >/dev/null || {
    say "debootstrap is missing (run hack/docker-up.sh)"
    exit 1
  }
  MIRROR=$("$(dirname "${BASH_SOURCE[0]}")/../hack/debian-mirror.sh" "$SUITE") || exit 1
  root=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  say "debootstrap $SUITE ($PACKAGES) from $MIRROR into $root (once, a few minutes)"
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR" \
    >"$CACHE/debootstrap.log" 2>&1 || {
    tail -n 20 "$CACHE/debootstrap.log" >&2
    say "debootstrap failed (log: $CACHE/debootstrap.log)"
    exit 1
  }
  # Smaller image, and no stale package lists baked in.
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc \
    "$root"/usr/share/man "$root"/usr/share/locale
  tar -C "$root" --numeric-owner -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
  # Older roots (another package list or script) are never used again.
  find "$CACHE" -maxdepth 1 -name "base-$SUITE-*.tar" ! -path "$tarball" -delete
fi

say "docker import $tarball as $tag"
docker import \
  -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  -c 'CMD ["/bin/bash"]' \
  "$tarball" "$tag" >/dev/null
# Untag bases of older keys (images built on them keep their layers).
docker images rollout-base --format '{{.Repository}}:{{.Tag}}' | grep -vx "$tag" |
  xargs -r docker rmi >/dev/null 2>&1 || true
echo "$tag"
