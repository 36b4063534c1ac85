#!/usr/bin/env bash
# A pinned Helm 3, built from the Go module proxy (no release download, no registry), cached.
#
#   hack/helm.sh ARGS...        run helm (building it once first)
#   hack/helm.sh --path         print the path of the helm binary (building it once first)
#
# Version: ROLLOUT_HELM_VERSION (default v3.22.0, the module helm.sh/helm/v3).
# Cache:   ROLLOUT_HELM_CACHE (default ${ROLLOUT_LOCALKUBE_CACHE:-/var/cache/rollout-localkube}/helm):
#          <version>/helm plus a stamp; delete it to rebuild. Go caches: GOMODCACHE, GOCACHE.
# A cold build takes a few minutes (go build -p 2); a warm call returns at once.
set -euo pipefail

HELM_VERSION="${ROLLOUT_HELM_VERSION:-v3.22.0}"
CACHE="${ROLLOUT_HELM_CACHE:-${ROLLOUT_LOCALKUBE_CACHE:-/var/cache/rollout-localkube}/helm}"
DEST="${CACHE}/${HELM_VERSION}"
BIN="${DEST}/helm"
STAMP="${DEST}/.helm.stamp"

say() { printf '[helm.sh %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

find_go() {
  if [[ -n "${GO:-}" ]]; then echo "${GO}"; return; fi
  if command -v go >/dev/null 2>&1; then command -v go; return; fi
  if [[ -x /usr/local/go/bin/go ]]; then echo /usr/local/go/bin/go; return; fi
  say "no Go toolchain found; set GO=/path/to/go" && exit 1
}

build() {
  mkdir -p "${DEST}"
  exec 8>"${DEST}/.build.lock"
  flock 8
  if [[ -x "${BIN}" && -f "${STAMP}" && "$(cat "${STAMP}")" == "${HELM_VERSION}" ]]; then
    return 0
  fi
  local go_bin t0=${SECONDS} tmp
  go_bin="$(find_go)"
  say "building helm ${HELM_VERSION} from the Go module proxy (once; a few minutes) ..."
  tmp="$(mktemp -d "${DEST}/.gobin.XXXXXX")"
  # GOFLAGS=-mod=mod: install a module@version outside any workspace. Version ldflags make
  # `helm version` report the pinned version (as in Helm's own Makefile).
  CGO_ENABLED=0 GOFLAGS=-buildvcs=false GOBIN="${tmp}" "${go_bin}" install -p 2 -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION} -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
    "helm.sh/helm/v3/cmd/helm@${HELM_VERSION}"
  mv -f "${tmp}/helm" "${BIN}"
  rm -rf "${tmp}"
  echo "${HELM_VERSION}" >"${STAMP}"
  say "built helm ${HELM_VERSION} in $((SECONDS - t0))s: ${BIN}"
}

if ! [[ -x "${BIN}" && -f "${STAMP}" && "$(cat "${STAMP}")" == "${HELM_VERSION}" ]]; then
  build
fi
if [[ "${1:-}" == "--path" ]]; then
  echo "${BIN}"
  exit 0
fi
exec "${BIN}" "$@"
