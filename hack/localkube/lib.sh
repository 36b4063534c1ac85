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
# The real node's image tarballs (hack/images/build.sh).
LOCALKUBE_IMAGES="${ROLLOUT_LOCALKUBE_IMAGES:-${LOCALKUBE_CACHE}/images}"

# Cluster state (kwokctl workdir) and the stable kubeconfig path the tests read.
LOCALKUBE_CLUSTER="${ROLLOUT_LOCALKUBE_CLUSTER:-rollout}"
LOCALKUBE_WORKDIR="${ROLLOUT_LOCALKUBE_WORKDIR:-${LOCALKUBE_CACHE}/kwok}"
LOCALKUBE_KUBECONFIG="${ROLLOUT_LOCALKUBE_KUBECONFIG:-${LOCALKUBE_CACHE}/kubeconfig}"

# The real node (node.sh): its name, images (hack/images/build.sh) and RuntimeClass.
LOCALKUBE_NODE_NAME="${ROLLOUT_LOCALKUBE_NODE_NAME:-real-node}"
LOCALKUBE_PAUSE_IMAGE="rollout.local/pause:1"
LOCALKUBE_PYTHON_IMAGE="rollout.local/python:3-bookworm"
LOCALKUBE_RUNTIME_CLASS="runc"

# Components built by default; the node's only on request (build.sh kubelet containerd runc).
LOCALKUBE_DEFAULT_COMPONENTS=(kwokctl kwok etcd kube-apiserver kube-controller-manager kube-scheduler kubectl)
# The real node's own binaries (node.sh builds them on node-up).
LOCALKUBE_NODE_COMPONENTS=(kubelet containerd runc)

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
# Arguments: pairs of "command:package" (a command name, or an absolute path that must exist).
localkube_ensure_tools() {
  local missing=() pair cmd pkg
  for pair in "$@"; do
    cmd="${pair%%:*}"; pkg="${pair#*:}"
    if [[ "${cmd}" == /* ]]; then
      [[ -e "${cmd}" ]] || missing+=("${pkg}")
    else
      command -v "${cmd}" >/dev/null 2>&1 || missing+=("${pkg}")
    fi
  done
  ((${#missing[@]} == 0)) && return 0
  # Each package once (several commands may come from one).
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  command -v apt-get >/dev/null 2>&1 || localkube_die "missing tools (${missing[*]}) and no apt-get"
  localkube_log "installing Debian packages: ${missing[*]}"
  localkube_apt update -qq
  DEBIAN_FRONTEND=noninteractive localkube_apt install -y -qq --no-install-recommends \
    "${missing[@]}"
}

# apt-get that waits for a concurrent apt/dpkg run (another script installing its own packages):
# dpkg's lock through DPkg::Lock::Timeout, the package lists' lock by retrying for 10 minutes.
localkube_apt() {
  local sudo=() out rc deadline=$((SECONDS + 600))
  [[ "$(id -u)" == 0 ]] || sudo=(sudo)
  while true; do
    rc=0
    out="$("${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 "$@" 2>&1)" || rc=$?
    # dpkg's progress chatter only on failure.
    ((rc != 0)) || return 0
    if ((SECONDS >= deadline)) || ! grep -qi "could not get lock\|unable to lock" <<<"${out}"; then
      printf '%s\n' "${out}" >&2
      return "${rc}"
    fi
    localkube_log "apt-get $1: another apt/dpkg run holds the lock; waiting"
    sleep 5
  done
}
