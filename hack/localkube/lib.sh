# shellcheck shell=bash disable=SC2034  # variables are used by the scripts that source this
# Common settings for hack/localkube/*.sh. Source it; do not execute it.

LOCALKUBE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
. "${LOCALKUBE_DIR}/versions.env"

# Everything built or started lives outside the repository, keyed by the Kubernetes version.
LOCALKUBE_CACHE="${ROLLOUT_LOCALKUBE_CACHE:-/var/cache/rollout-localkube}"
LOCALKUBE_ROOT="${LOCALKUBE_CACHE}/${K8S_VERSION}"
LOCALKUBE_BIN="${LOCALKUBE_ROOT}/bin"
LOCALKUBE_SRC="${LOCALKUBE_ROOT}/src"

# Cluster state (kwokctl workdir) and the stable kubeconfig path the tests read.
LOCALKUBE_CLUSTER="${ROLLOUT_LOCALKUBE_CLUSTER:-rollout}"
LOCALKUBE_WORKDIR="${ROLLOUT_LOCALKUBE_WORKDIR:-${LOCALKUBE_CACHE}/kwok}"
LOCALKUBE_KUBECONFIG="${ROLLOUT_LOCALKUBE_KUBECONFIG:-${LOCALKUBE_CACHE}/kubeconfig}"

# Components built by default; kubelet only on request (build.sh kubelet).
LOCALKUBE_DEFAULT_COMPONENTS=(kwokctl kwok etcd kube-apiserver kube-controller-manager kube-scheduler kubectl)

localkube_log() { printf '[localkube %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
localkube_die() { localkube_log "ERROR: $*"; exit 1; }

# Find a Go toolchain (PATH, then the usual install location).
localkube_go() {
  if [[ -n "${GO:-}" ]]; then echo "${GO}"; return; fi
  if command -v go >/dev/null 2>&1; then command -v go; return; fi
  if [[ -x /usr/local/go/bin/go ]]; then echo /usr/local/go/bin/go; return; fi
  localkube_die "no Go toolchain found (need Go >= 1.26 for kwok ${KWOK_VERSION}); set GO=/path/to/go"
}

# Install missing Debian packages (apt-get update only when something is missing).
# Arguments: pairs of "command:package".
localkube_ensure_tools() {
  local missing=() pair cmd pkg
  for pair in "$@"; do
    cmd="${pair%%:*}"; pkg="${pair#*:}"
    command -v "${cmd}" >/dev/null 2>&1 || missing+=("${pkg}")
  done
  ((${#missing[@]} == 0)) && return 0
  command -v apt-get >/dev/null 2>&1 || localkube_die "missing tools (${missing[*]}) and no apt-get"
  local sudo=()
  [[ "$(id -u)" == 0 ]] || sudo=(sudo)
  localkube_log "installing Debian packages: ${missing[*]}"
  "${sudo[@]}" apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}
