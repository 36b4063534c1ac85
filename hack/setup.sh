#!/usr/bin/env bash
# Install what the project needs on a fresh Debian machine (idempotent, quiet when done already):
# redis-server and bubblewrap from apt, and the package (+ dev tools with --dev) from PyPI into
# the project's own virtual environment (never the system interpreter):
#
#   hack/setup.sh [--dev] [--docs] [--train]
#
# --dev adds the test and lint tools and the docs site's (hack/test.sh builds the site);
# --docs those alone (mkdocs and its plugins, pinned in pyproject.toml's `docs` extra); --train
# the trainer side's libraries (torch, transformers, TRL: several GB, PyPI's x86_64 torch is a
# CUDA build that runs on the CPU), pinned in pyproject.toml's `train` extra, for the tiny
# engine, the adapters' tests and the learning benchmark.
#
# The environment is ${ROLLOUT_VENV:-<repo>/.venv}, created with `${PYTHON:-python3} -m venv`
# (python3-venv is installed with apt when Debian's python3 lacks it). The package is installed
# editable from this clone, so `.venv/bin/rollout` always runs this clone's code. Afterwards:
# `. .venv/bin/activate` (or call .venv/bin/rollout, .venv/bin/pytest directly).
# A stamp in the environment (pyproject.toml's hash + extras + this clone's path) makes a second
# call return at once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"

sudo=""
[[ $(id -u) -eq 0 ]] || sudo="sudo"
apt_install() {
  echo "setup: apt-get install $*" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v bwrap >/dev/null || need+=(bubblewrap)
((${#need[@]} == 0)) || apt_install "${need[@]}"
# The local sandboxes run the system's Python (Debian's python3) as uid 1000.
[[ -x /usr/bin/python3 ]] || { echo "setup: /usr/bin/python3 is missing" >&2; exit 1; }

extras=()
for arg in "$@"; do
  case "${arg}" in
    --dev) extras+=(dev docs) ;;
    --docs) extras+=(docs) ;;
    --train) extras+=(train) ;;
    *) echo "setup: unknown option ${arg} (--dev, --docs, --train)" >&2; exit 2 ;;
  esac
done
extra=""
((${#extras[@]} == 0)) || extra="[$(IFS=,; echo "${extras[*]}")]"
VENV="${ROLLOUT_VENV:-${ROOT}/.venv}"
[[ "${VENV}" == /* ]] || VENV="${ROOT}/${VENV}"
PYTHON="${PYTHON:-python3}"
stamp="${VENV}/.rollout-setup"
want="$(sha256sum pyproject.toml | cut -c1-16) ${extra:-[]} ${ROOT}"
# A stamp with more extras satisfies a call that asks for fewer (each includes the base).
have="$(cat "${stamp}" 2>/dev/null || true)"
read -r have_hash have_extras have_root <<<"${have:-- [] -}"
satisfied=1
[[ "${have_hash} ${have_root}" == "${want%% *} ${ROOT}" ]] || satisfied=0
for e in "${extras[@]}"; do
  [[ ",${have_extras//[\[\]]/}," == *",${e},"* ]] || satisfied=0
done
if [[ -x "${VENV}/bin/python" ]] && ((satisfied)); then
  exit 0
fi

if [[ ! -x "${VENV}/bin/python" ]]; then
  if ! "${PYTHON}" -c 'import ensurepip, venv' 2>/dev/null; then
    # Debian splits venv/ensurepip out of python3.
    ver="$("${PYTHON}" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    apt_install "python${ver}-venv"
  fi
  echo "setup: creating ${VENV} (${PYTHON} -m venv)" >&2
  "${PYTHON}" -m venv "${VENV}"
fi
echo "setup: ${VENV}/bin/pip install -e .${extra}" >&2
"${VENV}/bin/python" -m pip install -q --disable-pip-version-check -e ".${extra}"
# The editable install must point at this clone (a copied .venv would point elsewhere).
where="$(cd / && "${VENV}/bin/python" -c 'import rollout_worker, os; print(os.path.dirname(os.path.dirname(rollout_worker.__file__)))')"
[[ "${where}" == "${ROOT}" ]] || {
  echo "setup: ${VENV} imports rollout_worker from ${where}, not ${ROOT}" >&2
  exit 1
}
printf '%s\n' "${want}" >"${stamp}"
