#!/usr/bin/env bash
# The released trainer libraries the adapters are tested against (tests/integration/
# test_trainer_libraries.py), each in its own folder beside the project's venv, not in it:
#
#   ${ROLLOUT_TRAINER_LIBS:-<repo>/.cache/trainer-libs}/verl    verl 0.9.1
#   ${ROLLOUT_TRAINER_LIBS:-<repo>/.cache/trainer-libs}/skyrl   skyrl 0.3.0 (then the verl one
#                                                               on PYTHONPATH, for ray)
#
# Each is `pip install --no-deps --target` of the library and only the packages its import of
# the adapters' types needs (pinned below, found by importing them), so the venv's torch and
# transformers are used (PYTHONPATH=<folder> with the venv's python) and nothing multi-GB is
# downloaded again. Not the libraries' declared requirements: verl asks transformers<5.11 and
# skyrl <=5.8.0, the venv has 5.25.0; importing their types works with it, training with them
# is not what is tested. A folder whose stamp lists these pins is left alone (a second run
# takes well under a second). The pip cache is pip's own (PIP_CACHE_DIR; hack/with-caches.sh
# moves it and this folder). Prints nothing but errors; `-v` says what it did.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROLLOUT_VENV:-${ROOT}/.venv}"
[[ "${VENV}" == /* ]] || VENV="${ROOT}/${VENV}"
LIBS="${ROLLOUT_TRAINER_LIBS:-${ROOT}/.cache/trainer-libs}"
[[ "${LIBS}" == /* ]] || LIBS="${ROOT}/${LIBS}"
verbose=0
[[ "${1:-}" == "-v" ]] && verbose=1

# verl/experimental/agent_loop/agent_loop.py imports ray, hydra, omegaconf, tensordict and
# verl's own modules (fastapi, uvicorn, opentelemetry through its rollout servers).
VERL=(
  verl==0.9.1
  ray==2.60.0 msgpack==1.2.4 protobuf==7.36.2 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  hydra-core==1.3.8 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3
  tensordict==0.10.0 pyvers==0.1.0 cloudpickle==3.1.3
  codetiming==1.4.0 cachetools==8.0.2
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 opentelemetry-api==1.45.3
)
# skyrl/train/generators/__init__.py imports the gym generator: skyrl_gym, loguru, omegaconf
# (verl's 2.3.0, so the two folders stack); skyrl/train/utils/trainer_utils.py (SkyRL's own
# validate_generator_output) adds torchdata and jaxtyping, and ray, which the test takes from
# the verl folder (PYTHONPATH=skyrl:verl) rather than downloading it twice.
SKYRL=(
  skyrl==0.3.0
  skyrl-gym==0.4.0 loguru==0.7.3 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3
  torchdata==0.11.0 jaxtyping==0.3.11 wadler-lindig==0.1.8
)

install() {
  local name="$1"
  shift
  local dir="${LIBS}/${name}" want
  want="$(printf '%s\n' "$@")"
  if [[ -f "${dir}/.rollout-pins" && "$(cat "${dir}/.rollout-pins")" == "${want}" ]]; then
    ((verbose)) && echo "trainer-libs: ${dir} has its pins" >&2
    return 0
  fi
  ((verbose)) && echo "trainer-libs: installing ${name} into ${dir}" >&2
  rm -rf "${dir}.tmp"
  "${VENV}/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    --target "${dir}.tmp" "$@"
  printf '%s\n' "$@" >"${dir}.tmp/.rollout-pins"
  rm -rf "${dir}"
  mv "${dir}.tmp" "${dir}"
}

mkdir -p "${LIBS}"
install verl "${VERL[@]}"
install skyrl "${SKYRL[@]}"
