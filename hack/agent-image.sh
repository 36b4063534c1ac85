#!/usr/bin/env bash
# The real node's agent image: the local Python image plus the agent environments of
# hack/agent-envs.sh (mini-swe-agent, the openai client and its example agent), made at
# /opt/rollout-agents with the host's /usr/bin/python3, the same Debian interpreter the image
# has, so the venvs' paths and shebangs hold inside it. Built with Docker, imported into the
# node's containerd (no registry). Prints the image name.
#
#   hack/agent-image.sh        (needs hack/docker-up.sh's engine and a running real node)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. hack/localkube/lib.sh
AGENTS=/opt/rollout-agents
ROLLOUT_LOCAL_PYTHON=/usr/bin/python3 ./hack/agent-envs.sh "${AGENTS}" >/dev/null
tag="$(cat hack/agent-envs.sh "${AGENTS}"/openai/openai_chat_agent.py | sha256sum | cut -c1-12)"
image="rollout.local/agents:${tag}"
if ! docker image inspect "${image}" >/dev/null 2>&1; then
  docker image inspect "${LOCALKUBE_PYTHON_IMAGE}" >/dev/null 2>&1 \
    || docker load -i "$(./hack/images/build.sh python | awk '{print $2}')" >&2
  printf 'FROM %s\nCOPY . %s\n' "${LOCALKUBE_PYTHON_IMAGE}" "${AGENTS}" \
    | docker build -q -t "${image}" -f - "${AGENTS}" >&2
fi
# Where hack/localkube/node.sh puts the node's containerd (node 0: no suffix).
node_id="${ROLLOUT_LOCALKUBE_NODE_ID:-0}"
suffix=""
((node_id == 0)) || suffix="-${node_id}"
sock="${ROLLOUT_NODE_CONTAINERD_STATE:-/run/rollout-containerd2${suffix}}/containerd.sock"
# The node's own ctr (hack/localkube/build.sh builds it with its containerd), else PATH's.
ctr_bin="$(ls "${ROLLOUT_LOCALKUBE_CACHE:-/var/cache/rollout-localkube}"/v*/bin/ctr 2>/dev/null \
  | tail -n 1)"
[[ -n "${ctr_bin}" ]] || ctr_bin=ctr
if ! "${ctr_bin}" --address "${sock}" -n k8s.io images ls -q | grep -qxF "docker.io/${image}" \
  && ! "${ctr_bin}" --address "${sock}" -n k8s.io images ls -q | grep -qxF "${image}"; then
  docker save "${image}" | "${ctr_bin}" --address "${sock}" -n k8s.io images import - >&2
fi
# Pinned, so a low disk never makes the kubelet delete it (hack/localkube/node.sh: pin_image).
pinned=""
for name in "${image}" "docker.io/${image}"; do
  "${ctr_bin}" --address "${sock}" -n k8s.io images label "${name}" \
    io.cri-containerd.pinned=pinned >/dev/null 2>&1 && pinned=yes
done
[[ -n "${pinned}" ]] || { echo "agent-image: could not pin ${image} in containerd" >&2; exit 1; }
echo "${image}"
