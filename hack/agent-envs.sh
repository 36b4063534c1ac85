#!/usr/bin/env bash
# Agent environments for the tests and the README's examples: virtual environments holding
# third-party agents from PyPI, made with the local sandboxes' interpreter so they run inside
# bubblewrap (a sandbox sees the agent env read-only at the same path: `--agent-env DIR`).
#
#   hack/agent-envs.sh [DIR]      (default: .agent-envs)  ->  DIR/openai  DIR/mini
#
# DIR/openai holds the official client and the example agent (openai_chat_agent.py);
# DIR/mini holds mini-swe-agent.
#
# Each env is made once (a `.done` marker after a complete install); pip's own cache applies.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DIR="${1:-.agent-envs}"
PY="${ROLLOUT_LOCAL_PYTHON:-/usr/bin/python3}"
[[ -x "${PY}" ]] || PY="$(command -v python3)"
OPENAI_VERSION=3.57.0
MINI_VERSION=2.4.6

make_env() { # name, pip requirements...
  local name="$1" env="${DIR}/$1"
  shift
  [[ -f "${env}/.done" ]] && return 0
  rm -rf "${env}"
  echo "agent-envs: ${env} (${*})" >&2
  "${PY}" -m venv "${env}"
  "${env}/bin/pip" install --quiet --disable-pip-version-check "$@"
  touch "${env}/.done"
}

mkdir -p "${DIR}"
make_env openai "openai==${OPENAI_VERSION}"
# The example agent (rollout_worker/data/agents) beside its client, where sandboxes see it.
cp rollout_worker/data/agents/openai_chat_agent.py "${DIR}/openai/"
make_env mini "mini-swe-agent==${MINI_VERSION}"
echo "$(cd "${DIR}" && pwd)"
