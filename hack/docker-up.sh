#!/usr/bin/env bash
# Make a local Docker engine and Compose v2 usable on a fresh Debian machine (idempotent):
#   - apt-get install docker.io (dockerd, containerd, tini as docker-init) and debootstrap;
#   - build the `docker compose` v2 CLI plugin from the Go module proxy when no v2 is found
#     (Debian ships only compose v1), cached under $ROLLOUT_DOCKER_CACHE;
#   - start dockerd in the background when `docker info` fails, log in $ROLLOUT_DOCKER_CACHE,
#     and wait until it answers.
# Exits non-zero with the reason when any step fails: callers (tests) must fail, not skip.
# Relocatable: ROLLOUT_DOCKER_CACHE (compose binary, dockerd log, build-base/build-wheels
# caches; default /var/cache/rollout-docker), ROLLOUT_DOCKER_DATA_ROOT (the engine's images and
# containers, passed as --data-root when this script starts dockerd; default dockerd's own
# /var/lib/docker; an engine that is already running is used as it is), GOMODCACHE/GOCACHE (the
# compose build).
set -euo pipefail

CACHE="${ROLLOUT_DOCKER_CACHE:-/var/cache/rollout-docker}"
DATA_ROOT="${ROLLOUT_DOCKER_DATA_ROOT:-}"
COMPOSE_VERSION="${ROLLOUT_COMPOSE_VERSION:-v2.40.3}"
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
DOCKERD_LOG="$CACHE/dockerd.log"
START_SECONDS="${ROLLOUT_DOCKERD_START_SECONDS:-60}"

say() { echo "docker-up: $*" >&2; }
die() {
  say "$*"
  exit 1
}

sudo=""
[[ $(id -u) -eq 0 ]] || sudo="sudo"
$sudo mkdir -p "$CACHE"

# -- packages --------------------------------------------------------------------------------
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if ((${#need[@]})); then
  say "apt-get install ${need[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${need[@]}" iptables ca-certificates >/dev/null
fi
command -v docker >/dev/null || die "no docker CLI after installing docker.io"

# -- compose v2 ------------------------------------------------------------------------------
# (No `| grep -q` under pipefail: its early exit SIGPIPEs the writer and fails the pipeline.)
compose_is_v2() { [[ "$(docker compose version --short 2>/dev/null)" =~ ^v?2\. ]]; }
if ! compose_is_v2; then
  built="$CACHE/compose-$COMPOSE_VERSION/docker-compose"
  if [[ ! -x "$built" ]]; then
    go=$(command -v go || echo /usr/local/go/bin/go)
    [[ -x "$go" ]] || die "compose v2 is missing and there is no Go toolchain to build it"
    say "building docker compose $COMPOSE_VERSION from the Go module proxy (once, ~3 min)"
    work=$(mktemp -d)
    # `go install pkg@version` refuses modules with exclude/replace directives, so build in
    # the downloaded module's own directory, where its go.mod applies.
    dir=$(cd "$work" && GOFLAGS=-mod=mod "$go" mod download -json \
      "github.com/docker/compose/v2@$COMPOSE_VERSION" | sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p')
    [[ -d "$dir" ]] || die "could not download github.com/docker/compose/v2@$COMPOSE_VERSION"
    (cd "$dir" && CGO_ENABLED=0 GOFLAGS=-buildvcs=false "$go" build -trimpath \
      -ldflags "-s -w -X github.com/docker/compose/v2/internal.Version=$COMPOSE_VERSION" \
      -o "$work/docker-compose" ./cmd) || die "building compose failed"
    $sudo mkdir -p "$(dirname "$built")"
    $sudo mv "$work/docker-compose" "$built"
    rm -rf "$work"
  fi
  $sudo mkdir -p "$PLUGIN_DIR"
  $sudo install -m 0755 "$built" "$PLUGIN_DIR/docker-compose"
  compose_is_v2 || die "docker compose still does not report v2 (see $PLUGIN_DIR)"
fi

# -- the engine ------------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
  if pgrep -x dockerd >/dev/null; then
    say "dockerd is running but not answering yet; waiting"
  else
    say "starting dockerd (log: $DOCKERD_LOG)"
    # Detached from the caller (own session, no inherited descriptors) so it outlives the test
    # run that started it and never holds a pytest pipe open.
    args=()
    if [[ -n "$DATA_ROOT" ]]; then
      $sudo mkdir -p "$DATA_ROOT"
      args+=(--data-root "$DATA_ROOT")
    fi
    $sudo setsid nohup dockerd "${args[@]}" >>"$DOCKERD_LOG" 2>&1 </dev/null &
  fi
  end=$((SECONDS + START_SECONDS))
  until docker info >/dev/null 2>&1; do
    if ((SECONDS > end)); then
      tail -n 30 "$DOCKERD_LOG" >&2 || true
      die "dockerd did not answer within ${START_SECONDS}s (log: $DOCKERD_LOG)"
    fi
    sleep 0.5
  done
fi
root=$(docker info -f '{{.DockerRootDir}}' 2>/dev/null || true)
if [[ -n "$DATA_ROOT" && "$root" != "$DATA_ROOT" ]]; then
  say "note: the running engine keeps its data in $root, not ROLLOUT_DOCKER_DATA_ROOT=$DATA_ROOT"
fi
say "ready: engine $(docker version -f '{{.Server.Version}}') (data ${root:-?}), compose $(docker compose version --short)"
