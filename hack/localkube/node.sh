# shellcheck shell=bash
# The local cluster's real node: kubelet, containerd and runc (all built by build.sh from the Go
# module proxy) + a CNI bridge, with locally built images. Sourced by cluster.sh (node-up,
# node-down, node-status); needs lib.sh and cluster.sh's kctl/CLUSTER_DIR. Runs as root.
#
# Everything it starts or creates is its own and is removed by node_down:
#   containerd  --config ${NODE_DIR}/containerd.toml, root /var/lib/rollout-containerd2 (images
#               stay there between runs), state /run/rollout-containerd2, socket
#               /run/rollout-containerd2/containerd.sock; never Docker's or the system's containerd
#               ("2": containerd 2's, never opened by the Debian containerd 1.6 earlier versions
#               of this script ran, which may still run from another checkout)
#   kubelet     root-dir /var/lib/rollout-kubelet, Pod logs /var/log/rollout-pods
#   network     bridge rollout0 (node IP 10.89.0.1/24, the kubelet listens there), host-local
#               IPAM state under /run/rollout-containerd2; no iptables rules (no masquerade, the
#               kubelet's iptables chains are off): Pods reach the node and nothing else
#   policies    CNI plugin rollout-netpol (chained after bridge) enforces NetworkPolicy in the
#               nftables table inet rollout-netpol-<id> (state /run/rollout-containerd2/netpol),
#               reading the API with a client certificate rollout-netpol:<node> (ClusterRole
#               and ClusterRoleBinding rollout-localkube-netpol: get pods, list networkpolicies)
#   API objects Node real-node (label rollout.dev/node=real, taint rollout.dev/node=real:
#               NoSchedule), RuntimeClass runc (handler runc), the netpol ClusterRole/Binding

NODE_DIR="${LOCALKUBE_CACHE}/node"
NODE_NAME="${LOCALKUBE_NODE_NAME}"
NODE_LABEL_KEY="rollout.dev/node"
NODE_LABEL_VALUE="real"
# Machine-wide names (bridge, state directories, ports, cgroup root) of one real node. A second
# cluster on the same machine (another ROLLOUT_LOCALKUBE_CACHE, e.g. a cold-path proof) sets
# ROLLOUT_LOCALKUBE_NODE_ID=1..200 so its node shares nothing with the default one (id 0):
# bridge rollout<N>, 10.89.<N>.0/24, /var/lib/rollout-containerd2-<N>, /run/rollout-containerd2-<N>,
# /var/lib/rollout-kubelet-<N>, /var/log/rollout-pods-<N>, kubelet ports 10250+10N/10248+10N,
# cgroup root /rollout-node-<N>.
NODE_ID="${ROLLOUT_LOCALKUBE_NODE_ID:-0}"
[[ "${NODE_ID}" =~ ^[0-9]+$ ]] && ((NODE_ID <= 200)) \
  || localkube_die "ROLLOUT_LOCALKUBE_NODE_ID must be 0..200, not '${NODE_ID}'"
NODE_SUFFIX=""
((NODE_ID == 0)) || NODE_SUFFIX="-${NODE_ID}"
CONTAINERD_ROOT="${ROLLOUT_NODE_CONTAINERD_ROOT:-/var/lib/rollout-containerd2${NODE_SUFFIX}}"
CONTAINERD_STATE="${ROLLOUT_NODE_CONTAINERD_STATE:-/run/rollout-containerd2${NODE_SUFFIX}}"
CONTAINERD_SOCK="${CONTAINERD_STATE}/containerd.sock"
CONTAINERD_CONFIG="${NODE_DIR}/containerd.toml"
RUNC_ROOT="${CONTAINERD_STATE}/runc"
# The runtime's binaries (build.sh containerd runc), never the machine's.
CONTAINERD_BIN="${LOCALKUBE_BIN}/containerd"
CTR_BIN="${LOCALKUBE_BIN}/ctr"
SHIM_BIN="${LOCALKUBE_BIN}/containerd-shim-runc-v2"
RUNC_BIN="${LOCALKUBE_BIN}/runc"
# Localhost seccomp profiles (the kubelet's <root>/seccomp/rollout/...): bwrap-host.json lets a
# user-namespace Pod run bubblewrap (docs/sandbox-hosts.md).
SECCOMP_SRC="${LOCALKUBE_DIR}/seccomp"
KUBELET_ROOT="${ROLLOUT_NODE_KUBELET_ROOT:-/var/lib/rollout-kubelet${NODE_SUFFIX}}"
KUBELET_CONFIG="${NODE_DIR}/kubelet.yaml"
KUBELET_KUBECONFIG="${NODE_DIR}/kubelet.kubeconfig"
KUBELET_PORT="${LOCALKUBE_KUBELET_PORT:-$((10250 + 10 * NODE_ID))}"
KUBELET_HEALTHZ_PORT="${LOCALKUBE_KUBELET_HEALTHZ_PORT:-$((10248 + 10 * NODE_ID))}"
POD_LOGS_DIR="/var/log/rollout-pods${NODE_SUFFIX}"
# Debian's CNI plugins; containerd's bin_dir is our own directory: links to those, and a copy of
# rollout-netpol (NetworkPolicy, see that file).
CNI_BIN_DIR="/usr/lib/cni"
CNI_PLUGIN_DIR="${NODE_DIR}/cni-bin"
CNI_CONF_DIR="${NODE_DIR}/cni"
NETPOL_PLUGIN="${LOCALKUBE_DIR}/rollout-netpol"
NETPOL_TABLE="rollout-netpol-${NODE_ID}"
NETPOL_STATE="${CONTAINERD_STATE}/netpol"
NETPOL_USER="rollout-netpol:${NODE_NAME}"
NETPOL_RBAC="rollout-localkube-netpol"
CNI_NETWORK="rollout-pods${NODE_SUFFIX}"
CNI_IPAM_DIR="${CONTAINERD_STATE}/cni-ipam"
BRIDGE="rollout${NODE_ID}"
# The kubelet's cgroup root ("/" for the default node: its Pods under /kubepods).
CGROUP_ROOT="/"
((NODE_ID == 0)) || CGROUP_ROOT="/rollout-node-${NODE_ID}"
# The bridge's address is the node IP: the kubelet refuses loopback node IPs, and this one is
# reachable from this machine (and its Pods) only.
NODE_IP="${LOCALKUBE_NODE_IP:-10.89.${NODE_ID}.1}"
POD_SUBNET="${LOCALKUBE_POD_SUBNET:-10.89.${NODE_ID}.0/24}"
NODE_READY_TIMEOUT="${LOCALKUBE_NODE_READY_TIMEOUT:-120}"

ctr_() { "${CTR_BIN}" --address "${CONTAINERD_SOCK}" --namespace k8s.io "$@"; }

node_ensure_packages() {
  localkube_ensure_tools ip:iproute2 openssl:openssl \
    flock:util-linux pgrep:procps setsid:util-linux debootstrap:debootstrap \
    nft:nftables /usr/bin/python3:python3 \
    "${CNI_BIN_DIR}/bridge:containernetworking-plugins" \
    "${CNI_BIN_DIR}/host-local:containernetworking-plugins" \
    "${CNI_BIN_DIR}/loopback:containernetworking-plugins"
}

# Is PID a live process of EXE whose command line mentions MARK? (Stale pid files, reused PIDs.)
node_ours() { # pid exe mark
  local pid="$1" exe cmdline
  [[ "${pid}" =~ ^[0-9]+$ ]] || return 1
  exe="$(readlink "/proc/${pid}/exe" 2>/dev/null)" || return 1
  [[ "${exe}" == "$2" ]] || return 1
  cmdline="$(tr '\0' ' ' 2>/dev/null <"/proc/${pid}/cmdline")" || return 1
  [[ "${cmdline}" == *"$3"* ]]
}

node_pids() { # exe mark: every live process of ours
  local pid
  for pid in $(pgrep -f -- "$2" || true); do
    node_ours "${pid}" "$1" "$2" && echo "${pid}"
  done
  return 0
}

containerd_pids() { node_pids "${CONTAINERD_BIN}" "--config ${CONTAINERD_CONFIG}"; }
kubelet_pids() { node_pids "${LOCALKUBE_BIN}/kubelet" "--config=${KUBELET_CONFIG}"; }
shim_pids() { node_pids "${SHIM_BIN}" "-address ${CONTAINERD_SOCK}"; }

stop_pids() { # what pids...: TERM, wait up to 10 s, KILL
  local what="$1" pid left
  shift
  (($#)) || return 0
  kill "$@" 2>/dev/null || true
  for _ in $(seq 1 100); do
    left=0
    for pid in "$@"; do kill -0 "${pid}" 2>/dev/null && left=1; done
    ((left)) || return 0
    sleep 0.1
  done
  localkube_log "${what} did not stop in 10s; killing it"
  kill -9 "$@" 2>/dev/null || true
  sleep 0.2
}

# DAEMON_PID is the started process. Startup loops test it with kill -0 rather than by matching
# /proc/<pid>/exe: until the background child has exec'd, its exe is still bash, and a match
# found nothing and called a starting kubelet dead after 0 s (a CI run failed so). With -w, $!
# lives as long as the daemon even when setsid has to fork.
DAEMON_PID=""
start_daemon() { # log exe args...: start detached (own session, no inherited fds)
  local log="$1"
  shift
  # Every inherited descriptor above 2 is closed: a daemon that kept a caller's lock file open
  # (`flock -x LOCK cluster.sh node-up`) would hold that lock for as long as the node runs.
  (
    for fd in /proc/self/fd/*; do
      fd="${fd##*/}"
      ((fd > 2)) && eval "exec ${fd}>&-" 2>/dev/null
    done
    exec setsid -w "$@" </dev/null >>"${log}" 2>&1
  ) &
  DAEMON_PID=$!
}

daemon_alive() { kill -0 "${DAEMON_PID}" 2>/dev/null; }

# The API server's address in the cluster's kubeconfig.
api_server() {
  local server
  server="$(kctl config view --raw -o jsonpath='{.clusters[0].cluster.server}')"
  [[ -n "${server}" ]] || localkube_die "no API server address in ${LOCALKUBE_KUBECONFIG}"
  echo "${server}"
}

install_cni_plugins() {
  local p
  mkdir -p "${CNI_PLUGIN_DIR}"
  for p in bridge host-local loopback; do ln -sfn "${CNI_BIN_DIR}/${p}" "${CNI_PLUGIN_DIR}/${p}"; done
  install -m 0755 "${NETPOL_PLUGIN}" "${CNI_PLUGIN_DIR}/rollout-netpol.tmp"
  mv -f "${CNI_PLUGIN_DIR}/rollout-netpol.tmp" "${CNI_PLUGIN_DIR}/rollout-netpol"
}

write_containerd_config() {
  mkdir -p "${NODE_DIR}" "${CNI_CONF_DIR}"
  cat >"${CONTAINERD_CONFIG}.tmp" <<TOML
# Generated by hack/localkube/node.sh: the real node's private containerd (2.x, config version 3).
version = 3
root = "${CONTAINERD_ROOT}"
state = "${CONTAINERD_STATE}"
# NRI's socket is machine-wide (/var/run/nri); tracing is not wanted.
disabled_plugins = ["io.containerd.nri.v1.nri", "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing"]

[grpc]
  address = "${CONTAINERD_SOCK}"

[ttrpc]
  address = "${CONTAINERD_SOCK}.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "${CONTAINERD_ROOT}/opt"
  [plugins."io.containerd.grpc.v1.cri"]
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
  [plugins."io.containerd.cri.v1.images"]
    snapshotter = "overlayfs"
    [plugins."io.containerd.cri.v1.images".pinned_images]
      sandbox = "${LOCALKUBE_PAUSE_IMAGE}"
  [plugins."io.containerd.cri.v1.runtime"]
    disable_apparmor = true
    enable_selinux = false
    netns_mounts_under_state_dir = true
    # These machines withhold CAP_SYS_RESOURCE even from root: nothing may lower its
    # oom_score_adj (the sandbox's default -998 fails in runc). Clamp to containerd's own.
    restrict_oom_score_adj = true
    # As containerd 1.x: no sysctls opening privileged ports and ping to every Pod user.
    enable_unprivileged_ports = false
    enable_unprivileged_icmp = false
    [plugins."io.containerd.cri.v1.runtime".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        runtime_path = "${SHIM_BIN}"
        snapshotter = "overlayfs"
        [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
          BinaryName = "${RUNC_BIN}"
          Root = "${RUNC_ROOT}"
          SystemdCgroup = false
    [plugins."io.containerd.cri.v1.runtime".cni]
      bin_dirs = ["${CNI_PLUGIN_DIR}"]
      conf_dir = "${CNI_CONF_DIR}"
      max_conf_num = 1
TOML
  mv -f "${CONTAINERD_CONFIG}.tmp" "${CONTAINERD_CONFIG}"

  local gateway="${NODE_IP}" server
  server="$(api_server)"
  cat >"${CNI_CONF_DIR}/10-${CNI_NETWORK}.conflist.tmp" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "${CNI_NETWORK}",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "${BRIDGE}",
      "isGateway": true,
      "isDefaultGateway": false,
      "ipMasq": false,
      "hairpinMode": false,
      "ipam": {
        "type": "host-local",
        "dataDir": "${CNI_IPAM_DIR}",
        "ranges": [[{"subnet": "${POD_SUBNET}", "gateway": "${gateway}"}]]
      }
    },
    {
      "type": "rollout-netpol",
      "table": "${NETPOL_TABLE}",
      "stateDir": "${NETPOL_STATE}",
      "server": "${server}",
      "ca": "${NODE_DIR}/pki/ca.crt",
      "cert": "${NODE_DIR}/pki/netpol-client.crt",
      "key": "${NODE_DIR}/pki/netpol-client.key",
      "timeoutSeconds": 10,
      "log": "${NODE_DIR}/logs/netpol.log"
    }
  ]
}
JSON
  mv -f "${CNI_CONF_DIR}/10-${CNI_NETWORK}.conflist.tmp" "${CNI_CONF_DIR}/10-${CNI_NETWORK}.conflist"
}

# The node's identity: a client certificate system:node:<name> (group system:nodes) signed by the
# cluster's CA, so the API server's Node authorizer gives the kubelet exactly a node's rights.
issue_client_cert() { # name subject: ${NODE_DIR}/pki/<name>.{crt,key}, signed by the cluster CA
  local pki="${NODE_DIR}/pki"
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "${pki}/$1.key" -out "${pki}/$1.csr" -subj "$2" 2>/dev/null
  openssl x509 -req -in "${pki}/$1.csr" -CA "${CLUSTER_DIR}/pki/ca.crt" \
    -CAkey "${CLUSTER_DIR}/pki/ca.key" -set_serial "0x$(openssl rand -hex 8)" -days 30 \
    -extfile <(printf 'keyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n') \
    -out "${pki}/$1.crt" 2>/dev/null
  rm -f "${pki}/$1.csr"
  chmod 0600 "${pki}/$1.key"
}

write_kubelet_credentials() {
  local pki="${NODE_DIR}/pki" server
  mkdir -p "${pki}"
  chmod 0700 "${pki}"
  server="$(api_server)"
  cp "${CLUSTER_DIR}/pki/ca.crt" "${pki}/ca.crt"
  issue_client_cert kubelet-client "/O=system:nodes/CN=system:node:${NODE_NAME}"
  # rollout-netpol's identity: a user of its own, bound to read-only RBAC (apply_node_objects).
  issue_client_cert netpol-client "/CN=${NETPOL_USER}"
  cat >"${KUBELET_KUBECONFIG}" <<YAML
apiVersion: v1
kind: Config
clusters:
- name: localkube
  cluster:
    server: ${server}
    certificate-authority: ${pki}/ca.crt
users:
- name: ${NODE_NAME}
  user:
    client-certificate: ${pki}/kubelet-client.crt
    client-key: ${pki}/kubelet-client.key
contexts:
- name: ${NODE_NAME}
  context: {cluster: localkube, user: ${NODE_NAME}}
current-context: ${NODE_NAME}
YAML
  chmod 0600 "${KUBELET_KUBECONFIG}"
}

write_kubelet_config() {
  cat >"${KUBELET_CONFIG}.tmp" <<YAML
# Generated by hack/localkube/node.sh
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: ${NODE_IP}
port: ${KUBELET_PORT}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: ${KUBELET_HEALTHZ_PORT}
containerRuntimeEndpoint: unix://${CONTAINERD_SOCK}
imageServiceEndpoint: unix://${CONTAINERD_SOCK}
# cgroup v1 hosts: cgroupfs driver (no systemd), no swap check, no refusal of cgroup v1.
cgroupDriver: cgroupfs
cgroupRoot: ${CGROUP_ROOT}
failSwapOn: false
failCgroupV1: false
# Only the API server (its kubelet client certificate is signed by the cluster CA) may call in;
# requests are authorised by the API server (SubjectAccessReview).
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: ${NODE_DIR}/pki/ca.crt}
authorization:
  mode: Webhook
registerNode: true
registerWithTaints:
- {key: ${NODE_LABEL_KEY}, value: ${NODE_LABEL_VALUE}, effect: NoSchedule}
# No iptables rules on this shared machine; no hairpin (no Services here).
makeIPTablesUtilChains: false
hairpinMode: none
podLogsDir: ${POD_LOGS_DIR}
resolvConf: /etc/resolv.conf
serializeImagePulls: false
# The images are imported, never pulled: never garbage-collect them, and do not evict Pods for
# a disk that a test machine fills on purpose.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  nodefs.inodesFree: 1%
  imagefs.available: 1%
maxPods: 110
# Task images on sandbox hosts are image volumes (KEP-4639): beta but off by default in 1.34
# (on by default from 1.35); the API server has the same gate (cluster.sh).
featureGates:
  ImageVolume: true
# No CAP_SYS_RESOURCE here (see restrict_oom_score_adj in containerd.toml).
oomScoreAdj: 0
YAML
  mv -f "${KUBELET_CONFIG}.tmp" "${KUBELET_CONFIG}"
}

install_seccomp_profiles() {
  mkdir -p "${KUBELET_ROOT}/seccomp/rollout"
  install -m 0644 "${SECCOMP_SRC}"/*.json "${KUBELET_ROOT}/seccomp/rollout/"
}

ensure_bridge() {
  if ! ip link show "${BRIDGE}" >/dev/null 2>&1; then
    ip link add "${BRIDGE}" type bridge
  fi
  local prefix="${POD_SUBNET#*/}"
  if ! grep -qF "inet ${NODE_IP}/${prefix}" <<<"$(ip -4 addr show dev "${BRIDGE}")"; then
    ip addr add "${NODE_IP}/${prefix}" dev "${BRIDGE}"
  fi
  # A MAC of its own, never a port's: a bridge without one takes the lowest MAC of its ports and
  # changes it as Pods' veths come and go, while running Pods keep the old one for the node IP
  # in their ARP caches; their packets to the node (the policy endpoint) then go nowhere until
  # that entry expires (requests stalled 7-70 s in bench_slots). The bridge CNI plugin pins it
  # only when it adds the gateway address itself, and ours is added above.
  local mac
  mac="$(printf '02:72:6c:6b:00:%02x' "${NODE_ID}")"
  if [[ "$(cat "/sys/class/net/${BRIDGE}/address")" != "${mac}" ]]; then
    ip link set "${BRIDGE}" address "${mac}"
  fi
  ip link set "${BRIDGE}" up
  # Pod-to-Pod traffic is bridged; only br_netfilter shows it to the inet forward hook where
  # rollout-netpol filters it. Turned on for this bridge only (the machine-wide sysctl
  # bridge-nf-call-iptables is left as it is; loading the module sets it to 1 if it was not loaded).
  [[ -d /proc/sys/net/bridge ]] || modprobe br_netfilter 2>/dev/null || true
  if [[ -d /proc/sys/net/bridge ]]; then
    ip link set "${BRIDGE}" type bridge nf_call_iptables 1
  else
    localkube_log "WARNING: no br_netfilter: NetworkPolicy does not filter Pod-to-Pod traffic" \
      "on ${BRIDGE} (Pod-to-node traffic is filtered)"
  fi
}

netpol_table_exists() {
  command -v nft >/dev/null 2>&1 && nft list table inet "${NETPOL_TABLE}" >/dev/null 2>&1
}

# The kubelet requires its cgroup root to exist in every hierarchy (cgroup v1) or in the unified one.
ensure_cgroup_root() {
  [[ "${CGROUP_ROOT}" != / ]] || return 0
  local h
  for h in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do
    [[ -d "${h}" && -f "${h}cgroup.procs" ]] || continue
    mkdir -p "${h}${CGROUP_ROOT#/}" 2>/dev/null || true
  done
}

containerd_ok() { "${CTR_BIN}" --address "${CONTAINERD_SOCK}" version >/dev/null 2>&1; }

start_containerd() {
  local pids
  pids="$(containerd_pids)"
  if [[ -n "${pids}" ]] && containerd_ok; then return 0; fi
  # shellcheck disable=SC2086
  [[ -z "${pids}" ]] || stop_pids containerd ${pids}
  mkdir -p "${NODE_DIR}/logs" "${CONTAINERD_ROOT}" "${CONTAINERD_STATE}"
  start_daemon "${NODE_DIR}/logs/containerd.log" "${CONTAINERD_BIN}" --config "${CONTAINERD_CONFIG}"
  local deadline=$((SECONDS + 30))
  until containerd_ok; do
    if ((SECONDS >= deadline)) || ! daemon_alive; then
      tail -n 30 "${NODE_DIR}/logs/containerd.log" >&2
      localkube_die "containerd did not start (log: ${NODE_DIR}/logs/containerd.log)"
    fi
    sleep 0.2
  done
  # The cluster's supervisor restarts it if it exits (cluster.sh: supervise_register).
  local pid
  pid="$(containerd_pids)"
  supervise_register containerd "${pid%%$'\n'*}" "${SUP_DIR}/containerd/pid"
}

# Build the images (cached tarballs), then import each one unless containerd already holds it
# from the same tarball.
IMAGE_TARBALLS=""
build_images() {
  IMAGE_TARBALLS="$("${LOCALKUBE_DIR}/../images/build.sh" all)" || localkube_die "image build failed"
}

# Pinned images are never removed by the kubelet: not by its image GC and not by the eviction
# manager, which deletes every unused unpinned image when the disk runs low whatever the GC
# thresholds say (a nearly full CI disk once took the python base away mid-suite, and every
# real-node test then failed on ErrImageNeverPull).
pin_image() {
  ctr_ images label "$1" io.cri-containerd.pinned=pinned >/dev/null \
    || localkube_die "could not pin $1 in containerd"
}

import_images() {
  local name tar stamp_dir="${CONTAINERD_ROOT}/rollout-images" stamp
  mkdir -p "${stamp_dir}"
  while read -r name tar; do
    [[ -n "${name}" ]] || continue
    stamp="${stamp_dir}/$(tr '/:' '__' <<<"${name}")"
    if [[ "$(cat "${stamp}" 2>/dev/null)" == "${tar}" ]] \
        && grep -qxF "${name}" <<<"$(ctr_ images ls -q)"; then
      pin_image "${name}"
      continue
    fi
    localkube_log "importing ${name} into containerd (k8s.io) from ${tar} ..."
    ctr_ images import "${tar}" >&2 \
      || localkube_die "ctr images import ${tar} failed"
    # (A here-string, not `ctr ... | grep -q`: under pipefail, grep -q's early exit SIGPIPEs ctr
    # and turns a found image into "missing".)
    grep -qxF "${name}" <<<"$(ctr_ images ls -q)" || localkube_die "${name} missing after import"
    pin_image "${name}"
    echo "${tar}" >"${stamp}"
  done <<<"${IMAGE_TARBALLS}"
}

# The kubelet evicts Pods when the disk's free space falls under evictionHard (1%), and the
# images and Pods of a suite need several GiB: refuse a too-full disk up front, in words.
NODE_MIN_FREE_GIB="${ROLLOUT_NODE_MIN_FREE_GIB:-8}"
node_check_disk() {
  local dir free_kib
  dir="$(dirname "${CONTAINERD_ROOT}")"
  free_kib="$(df -Pk "${dir}" | awk 'NR == 2 {print $4}')"
  if ((free_kib < NODE_MIN_FREE_GIB * 1024 * 1024)); then
    localkube_die "only $((free_kib / 1024 / 1024)) GiB free under ${dir}; the node needs at" \
      "least ${NODE_MIN_FREE_GIB} GiB (set ROLLOUT_NODE_MIN_FREE_GIB to change it)"
  fi
}

kubelet_healthz() {
  local reply
  { exec 6<>"/dev/tcp/127.0.0.1/${KUBELET_HEALTHZ_PORT}"; } 2>/dev/null || return 1
  printf 'GET /healthz HTTP/1.0\r\nHost: localhost\r\n\r\n' >&6
  reply="$(timeout 5 cat <&6)" || true
  exec 6<&-
  [[ "${reply}" == *$'\r\n\r\nok' ]]
}

kubelet_healthy() {
  [[ -n "$(kubelet_pids)" ]] && kubelet_healthz || return 1
  local status
  status="$(kctl get node "${NODE_NAME}" \
    -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" || return 1
  [[ "${status}" == True ]]
}

# Fingerprint of what the running node was started for: the cluster (its CA) and our configs.
node_fingerprint() {
  cat "${CLUSTER_DIR}/pki/ca.crt" "${LOCALKUBE_KUBECONFIG}" "${LOCALKUBE_DIR}/node.sh" \
    "${NETPOL_PLUGIN}" "${SECCOMP_SRC}"/*.json 2>/dev/null | sha256sum | cut -c1-16
}

node_healthy() {
  [[ "$(cat "${NODE_DIR}/fingerprint" 2>/dev/null)" == "$(node_fingerprint)" ]] || return 1
  [[ -n "$(containerd_pids)" ]] && containerd_ok || return 1
  kubelet_healthy
}

# The RuntimeClass, and what rollout-netpol may read (the Pod it is called for, its namespace's
# NetworkPolicies).
apply_node_objects() {
  kctl apply -f - >/dev/null <<YAML
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata:
  name: ${LOCALKUBE_RUNTIME_CLASS}
  labels: {rollout.dev/localkube: "true"}
handler: runc
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: ${NETPOL_RBAC}
  labels: {rollout.dev/localkube: "true"}
rules:
- {apiGroups: [""], resources: [pods], verbs: [get]}
- {apiGroups: [networking.k8s.io], resources: [networkpolicies], verbs: [list]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: ${NETPOL_RBAC}
  labels: {rollout.dev/localkube: "true"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: ${NETPOL_RBAC}}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "${NETPOL_USER}"}
YAML
}

delete_node_objects() {
  kctl delete clusterrolebinding,clusterrole "${NETPOL_RBAC}" --ignore-not-found \
    --request-timeout=10s >/dev/null 2>&1 || true
}

node_up_locked() {
  local t0=${SECONDS} t
  [[ "$(id -u)" == 0 ]] || localkube_die "the real node needs root (containerd, kubelet, network)"
  if node_healthy; then
    apply_node_objects
    echo "localkube: node '${NODE_NAME}' already up (checked in $((SECONDS - t0))s)"
    return 0
  fi
  local timings=""
  t=${SECONDS}
  node_ensure_packages
  node_check_disk
  "${LOCALKUBE_DIR}/build.sh" "${LOCALKUBE_NODE_COMPONENTS[@]}" >&2 \
    || localkube_die "kubelet/containerd/runc build failed"
  # Anything half-started (or started for a previous cluster) goes first, with its Node object
  # (the kubelet registers afresh; the Pod GC removes Pods that were bound to the old one).
  node_down_locked quiet
  node_claim
  kctl delete node "${NODE_NAME}" --ignore-not-found --request-timeout=20s >/dev/null
  timings+="prepare $((SECONDS - t))s"
  t=${SECONDS}
  build_images
  timings+=", images $((SECONDS - t))s"
  t=${SECONDS}
  mkdir -p "${NODE_DIR}/logs" "${POD_LOGS_DIR}" "${KUBELET_ROOT}"
  : >"${NODE_DIR}/logs/kubelet.log"
  : >"${NODE_DIR}/logs/containerd.log"
  : >"${NODE_DIR}/logs/netpol.log"
  write_kubelet_credentials
  apply_node_objects
  install_cni_plugins
  write_containerd_config
  ensure_bridge
  start_containerd
  timings+=", containerd $((SECONDS - t))s"
  t=${SECONDS}
  import_images
  timings+=", import $((SECONDS - t))s"
  write_kubelet_config
  install_seccomp_profiles
  ensure_cgroup_root
  t=${SECONDS}
  start_daemon "${NODE_DIR}/logs/kubelet.log" "${LOCALKUBE_BIN}/kubelet" \
    "--config=${KUBELET_CONFIG}" "--kubeconfig=${KUBELET_KUBECONFIG}" \
    "--root-dir=${KUBELET_ROOT}" "--cert-dir=${KUBELET_ROOT}/pki" \
    "--hostname-override=${NODE_NAME}" "--node-ip=${NODE_IP}" \
    "--node-labels=${NODE_LABEL_KEY}=${NODE_LABEL_VALUE}" --v=1
  local deadline=$((SECONDS + NODE_READY_TIMEOUT))
  until kubelet_healthy; do
    if ((SECONDS >= deadline)) || ! daemon_alive; then
      tail -n 40 "${NODE_DIR}/logs/kubelet.log" >&2
      localkube_die "node ${NODE_NAME} not Ready after $((SECONDS - t))s (log: ${NODE_DIR}/logs/kubelet.log)"
    fi
    sleep 0.5
  done
  timings+=", kubelet to Ready $((SECONDS - t))s"
  local kpid
  kpid="$(kubelet_pids)"
  supervise_register kubelet "${kpid%%$'\n'*}" "${SUP_DIR}/kubelet/pid"
  node_fingerprint >"${NODE_DIR}/fingerprint"
  echo "${CLUSTER_DIR}" >"${NODE_DIR}/cluster"
  echo "localkube: node '${NODE_NAME}' up in $((SECONDS - t0))s (${timings})"
}

# One cluster per node id on this machine: another cluster's node (its directories, bridge, ports)
# is never torn down by ours. The claim is released by node-down/down, or when its cluster's
# directory is gone.
NODE_OWNER_FILE="/run/rollout-localkube/node-${NODE_ID}.owner"
node_claim() {
  local owner
  mkdir -p "${NODE_OWNER_FILE%/*}"
  owner="$(cat "${NODE_OWNER_FILE}" 2>/dev/null || true)"
  if [[ -n "${owner}" && "${owner}" != "${CLUSTER_DIR}" && -d "${owner}" ]]; then
    localkube_die "real node id ${NODE_ID} belongs to the cluster in ${owner}; give this cluster" \
      "another one (ROLLOUT_LOCALKUBE_NODE_ID=1..200) or stop that one first"
  fi
  echo "${CLUSTER_DIR}" >"${NODE_OWNER_FILE}"
}
node_release() {
  [[ "$(cat "${NODE_OWNER_FILE}" 2>/dev/null)" == "${CLUSTER_DIR}" ]] && rm -f "${NODE_OWNER_FILE}"
  return 0
}
node_owned_elsewhere() {
  local owner
  owner="$(cat "${NODE_OWNER_FILE}" 2>/dev/null || true)"
  [[ -n "${owner}" && "${owner}" != "${CLUSTER_DIR}" && -d "${owner}" ]]
}

# Does the node (if any) belong to this cluster? (One node per machine; another cluster name,
# ROLLOUT_LOCALKUBE_CLUSTER, must not stop it with its own `down`.)
node_belongs_here() {
  local owner
  owner="$(cat "${NODE_DIR}/cluster" 2>/dev/null)" || return 0
  [[ -z "${owner}" || "${owner}" == "${CLUSTER_DIR}" ]]
}

unmount_under() { # dir...: every mount point at or below the given directories, deepest first
  local dir m
  for dir in "$@"; do
    # (The kubelet bind-mounts its root directory onto itself to make it a shared mount.)
    while read -r m; do
      umount "${m}" 2>/dev/null || umount -l "${m}" 2>/dev/null || true
    done < <(awk -v d="${dir%/}" '$2 == d || index($2, d "/") == 1 {print $2}' /proc/self/mounts \
      | sort -r)
  done
}

# Stop the kubelet, every container of ours, containerd; remove mounts, network, state.
# Keeps ${CONTAINERD_ROOT} (the imported images) and ${NODE_DIR} (configs, logs).
node_exists() {
  [[ -n "$(kubelet_pids)$(containerd_pids)$(shim_pids)" || -d "${KUBELET_ROOT}" \
    || -d "${CONTAINERD_STATE}" ]] || ip link show "${BRIDGE}" >/dev/null 2>&1 \
    || netpol_table_exists
}

node_down_locked() {
  local quiet="${1:-}" t0=${SECONDS} pids id
  if node_owned_elsewhere; then
    [[ -n "${quiet}" ]] || echo "localkube: node id ${NODE_ID} belongs to another cluster ($(cat "${NODE_OWNER_FILE}")); not touching it"
    return 0
  fi
  if ! node_exists; then
    node_release
    [[ -n "${quiet}" ]] || echo "localkube: node '${NODE_NAME}' is not running"
    return 0
  fi
  [[ "$(id -u)" == 0 ]] || localkube_die "stopping the real node needs root"
  # No restarts of what is stopped here.
  supervise_forget kubelet containerd
  pids="$(kubelet_pids)"
  # shellcheck disable=SC2086
  stop_pids kubelet ${pids}
  if [[ -n "$(containerd_pids)" ]] && containerd_ok; then
    for id in $(ctr_ tasks ls -q 2>/dev/null); do
      ctr_ tasks kill --all --signal SIGKILL "${id}" >/dev/null 2>&1 || true
    done
    for id in $(ctr_ containers ls -q 2>/dev/null); do
      ctr_ tasks delete --force "${id}" >/dev/null 2>&1 || true
      ctr_ containers delete "${id}" >/dev/null 2>&1 || true
      # libcni's cached results for this sandbox (its Pod network and the loopback one).
      rm -f /var/lib/cni/results/*-"${id}"-* 2>/dev/null || true
    done
  fi
  # Whatever runc still has (containerd already gone, a crash): kill and delete it.
  if [[ -d "${RUNC_ROOT}" ]]; then
    local root
    for root in "${RUNC_ROOT}"/*; do
      [[ -d "${root}" ]] || continue
      for id in $("${RUNC_BIN}" --root "${root}" list -q 2>/dev/null); do
        "${RUNC_BIN}" --root "${root}" delete --force "${id}" >/dev/null 2>&1 || true
      done
    done
  fi
  pids="$(containerd_pids)"
  # shellcheck disable=SC2086
  stop_pids containerd ${pids}
  pids="$(shim_pids)"
  # shellcheck disable=SC2086
  stop_pids containerd-shim ${pids}
  unmount_under "${KUBELET_ROOT}" "${CONTAINERD_STATE}" "${CONTAINERD_ROOT}"
  rm -rf --one-file-system "${KUBELET_ROOT}" "${CONTAINERD_STATE}" "${POD_LOGS_DIR}"
  # The kubelet's /var/log/containers links into our Pod logs, and libcni's result cache.
  find /var/log/containers -maxdepth 1 -type l -lname "${POD_LOGS_DIR}/*" -delete 2>/dev/null || true
  rm -f /var/lib/cni/results/"${CNI_NETWORK}"-* 2>/dev/null || true
  # The kubelet's Pod cgroups (kubepods, in every v1 hierarchy), now empty.
  local cg
  for cg in /sys/fs/cgroup/*"${CGROUP_ROOT%/}"/kubepods; do
    if [[ -d "${cg}" ]]; then find "${cg}" -depth -type d -exec rmdir {} + 2>/dev/null || true; fi
  done
  if [[ "${CGROUP_ROOT}" != / ]]; then
    for cg in /sys/fs/cgroup/*"${CGROUP_ROOT}" /sys/fs/cgroup"${CGROUP_ROOT}"; do
      [[ -d "${cg}" ]] && { rmdir "${cg}" 2>/dev/null || true; }
    done
  fi
  if ip link show "${BRIDGE}" >/dev/null 2>&1; then ip link delete "${BRIDGE}" || true; fi
  # rollout-netpol's table (its state went with ${CONTAINERD_STATE}).
  if netpol_table_exists; then nft delete table inet "${NETPOL_TABLE}" || true; fi
  rm -rf "${NODE_DIR}/pki" "${NODE_DIR}/fingerprint" "${NODE_DIR}/cluster"
  node_release
  [[ -n "${quiet}" ]] || echo "localkube: node '${NODE_NAME}' down ($((SECONDS - t0))s)"
}
