#!/usr/bin/env bash
# Build a wheelhouse on the host for an offline `docker build`: every dependency of the project
# (from pyproject.toml) plus the image's extras (flower, setuptools), as wheels for the host's
# Python. Use it when build containers cannot reach PyPI (here: TLS is intercepted by a CA that
# only the host trusts). The image's Python must be the same X.Y as the host's.
# Prints the wheelhouse directory on stdout; cached by a content key in $ROLLOUT_DOCKER_CACHE.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CACHE="${ROLLOUT_DOCKER_CACHE:-/var/cache/rollout-docker}"
PYTHON="${PYTHON:-python3}"
# The Dockerfile's extras, plus what a dependency needs only on an older interpreter than the
# host's: redis wants async-timeout before Python 3.11.3, and bookworm has 3.11.2 (pip
# evaluates such markers against the host, so it would not fetch it by itself).
EXTRAS=("flower>=2" "setuptools>=68" "async-timeout>=4.0.3")

say() { echo "build-wheels: $*" >&2; }

requirements=$("$PYTHON" -c '
import sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join([*deps, *sys.argv[1:]]))' "${EXTRAS[@]}")
tag=$("$PYTHON" -c 'import sys, sysconfig; print(f"cp{sys.version_info[0]}{sys.version_info[1]}-" + sysconfig.get_platform())')
key=$(printf '%s\n%s\n' "$requirements" "$tag" | sha256sum | cut -c1-12)
dest="$CACHE/wheels-$tag-$key"

if [[ ! -f "$dest/.complete" ]]; then
  mkdir -p "$CACHE"
  tmp=$(mktemp -d "$CACHE/wheels.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  say "pip wheel for $tag into $dest"
  printf '%s\n' "$requirements" >"$tmp/requirements.txt"
  "$PYTHON" -m pip wheel -q --disable-pip-version-check \
    --wheel-dir "$tmp" -r "$tmp/requirements.txt" >&2
  touch "$tmp/.complete"
  rm -rf "$dest"
  mv "$tmp" "$dest"
  # Older wheelhouses (other requirements) are never used again.
  find "$CACHE" -maxdepth 1 -name "wheels-$tag-*" ! -path "$dest" -exec rm -rf {} +
fi
echo "$dest"
