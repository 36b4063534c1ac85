#!/usr/bin/env bash
# Build the local node's container images without any registry, as docker-archive tarballs that
# `ctr -n k8s.io images import` loads into the node's containerd.
#
#   hack/images/build.sh [IMAGE...]     IMAGE: pause | python | all (default: all)
#
# Prints one line per image on stdout: `<image name> <tarball>`; progress goes to stderr.
#
#   rollout.local/pause:1             the Pod sandbox image: a static Go binary (pause/main.go)
#   rollout.local/python:3-bookworm   Debian bookworm minbase + python3 + python-is-python3, so
#                                     `python` is on PATH; runs as any UID (no user entry needed);
#                                     + bubblewrap (not setuid), for sandbox-host Pods that run
#                                     the local backend's sandboxes (docs/sandbox-hosts.md)
#
# Tarballs are cached in ${ROLLOUT_LOCALKUBE_CACHE:-/var/cache/rollout-localkube}/images under
# a key made of this script, the pause source and the package list: a warm call only checks
# that the files exist. Environment: ROLLOUT_DEBIAN_MIRROR (default: this machine's apt source
# for bookworm, see hack/debian-mirror.sh), ROLLOUT_LOCALKUBE_IMAGES (the tarball cache).
set -euo pipefail
IMAGES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../localkube/lib.sh
. "${IMAGES_DIR}/../localkube/lib.sh"

PAUSE_IMAGE="${LOCALKUBE_PAUSE_IMAGE}"
PYTHON_IMAGE="${LOCALKUBE_PYTHON_IMAGE}"
SUITE=bookworm
MIRROR=""   # resolved only when the Python image must be built (hack/debian-mirror.sh)
PYTHON_PACKAGES=python3,python-is-python3,bubblewrap
OUT="${LOCALKUBE_IMAGES}"
BASE_PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

log() { printf '[images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

wanted=()
for arg in "$@"; do
  case "${arg}" in
    pause|python) wanted+=("${arg}") ;;
    all) wanted+=(pause python) ;;
    -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) localkube_die "unknown image: ${arg} (pause | python | all)" ;;
  esac
done
((${#wanted[@]})) || wanted=(pause python)

mkdir -p "${OUT}"
exec 7>"${OUT}/.build.lock"
flock 7

key_of() { # name, extra inputs...
  { cat "${BASH_SOURCE[0]}"; printf '%s\n' "$@"; } | sha256sum | cut -c1-12
}

# Write a docker-archive tarball (manifest.json + config + one uncompressed layer).
#   pack_image NAME ROOTFS_TAR OUT_TAR CONFIG_JSON_FRAGMENT
# CONFIG_JSON_FRAGMENT is the image's runtime config object ({"Env": [...], ...}).
pack_image() {
  local name="$1" layer="$2" out="$3" runtime_config="$4" work diff cfg created
  work="$(mktemp -d "${OUT}/.pack.XXXXXX")"
  mv "${layer}" "${work}/layer.tar"
  diff="$(sha256sum "${work}/layer.tar" | cut -d' ' -f1)"
  created="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  printf '{"architecture":"amd64","os":"linux","created":"%s","config":%s,%s}' \
    "${created}" "${runtime_config}" \
    "\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[\"sha256:${diff}\"]},\"history\":[{\"created\":\"${created}\",\"created_by\":\"hack/images/build.sh\"}]" \
    >"${work}/config.json"
  cfg="$(sha256sum "${work}/config.json" | cut -d' ' -f1)"
  mv "${work}/config.json" "${work}/${cfg}.json"
  printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["layer.tar"]}]' "${cfg}" "${name}" \
    >"${work}/manifest.json"
  tar -C "${work}" -cf "${out}.tmp" manifest.json "${cfg}.json" layer.tar
  mv -f "${out}.tmp" "${out}"
  rm -rf "${work}"
}

build_pause() {
  local src="${IMAGES_DIR}/pause" key out t0=${SECONDS} go_bin stage
  key="$(key_of "${PAUSE_IMAGE}" "$(cat "${src}/main.go" "${src}/go.mod")")"
  out="${OUT}/pause-${key}.tar"
  if [[ ! -s "${out}" ]]; then
    go_bin="$(localkube_go)"
    log "building ${PAUSE_IMAGE} (static Go binary) ..."
    stage="$(mktemp -d "${OUT}/.pause.XXXXXX")"
    (cd "${src}" && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false \
      "${go_bin}" build -trimpath -ldflags "-s -w" -o "${stage}/pause" .)
    tar -C "${stage}" --numeric-owner --owner=0 --group=0 -cf "${stage}.layer.tar" pause
    rm -rf "${stage}"
    pack_image "${PAUSE_IMAGE}" "${stage}.layer.tar" "${out}" \
      '{"Entrypoint":["/pause"],"User":"65535:65535","Env":["PATH='"${BASE_PATH}"'"]}'
    log "built ${PAUSE_IMAGE} in $((SECONDS - t0))s"
  fi
  echo "${PAUSE_IMAGE} ${out}"
}

ROOTFS=""
cleanup_rootfs() {
  [[ -n "${ROOTFS}" && -d "${ROOTFS}" ]] || return 0
  local m
  # debootstrap mounts proc/sys inside the target while it installs; never delete through them.
  while read -r m; do
    umount -l "${m}" 2>/dev/null || true
  done < <(awk -v r="${ROOTFS}/" 'index($2, r) == 1 {print $2}' /proc/self/mounts | sort -r)
  rm -rf --one-file-system "${ROOTFS}"
}

build_python() {
  local key out t0=${SECONDS}
  # The mirror is where the packages come from, not what they are: not part of the key.
  key="$(key_of "${PYTHON_IMAGE}" "${SUITE} ${PYTHON_PACKAGES}")"
  out="${OUT}/python-${SUITE}-${key}.tar"
  if [[ ! -s "${out}" ]]; then
    localkube_ensure_tools debootstrap:debootstrap
    MIRROR="$("${IMAGES_DIR}/../debian-mirror.sh" "${SUITE}")" || localkube_die "no Debian mirror"
    ROOTFS="$(mktemp -d "${OUT}/.rootfs.XXXXXX")"
    trap cleanup_rootfs EXIT
    local attempt
    for attempt in 1 2; do
      log "debootstrap ${SUITE} minbase + ${PYTHON_PACKAGES} from ${MIRROR} (attempt ${attempt}) ..."
      if debootstrap --variant=minbase --include="${PYTHON_PACKAGES}" "${SUITE}" "${ROOTFS}" \
          "${MIRROR}" >"${OUT}/debootstrap.log" 2>&1; then
        break
      fi
      tail -n 20 "${OUT}/debootstrap.log" >&2
      tail -n 20 "${ROOTFS}/debootstrap/debootstrap.log" >&2 2>/dev/null || true
      ((attempt < 2)) || localkube_die "debootstrap failed (log: ${OUT}/debootstrap.log)"
      cleanup_rootfs
      ROOTFS="$(mktemp -d "${OUT}/.rootfs.XXXXXX")"
    done
    [[ -x "${ROOTFS}/usr/bin/python" ]] || localkube_die "the rootfs has no /usr/bin/python"
    # Smaller image; no package lists, caches or device nodes baked in (the runtime mounts /dev).
    rm -rf "${ROOTFS}"/var/cache/apt/archives/*.deb "${ROOTFS}"/var/cache/apt/*.bin \
      "${ROOTFS}"/var/lib/apt/lists/* "${ROOTFS}"/usr/share/doc/* "${ROOTFS}"/usr/share/man/* \
      "${ROOTFS}"/usr/share/info/* "${ROOTFS}"/usr/share/locale/* "${ROOTFS}"/var/log/*
    find "${ROOTFS}/dev" -mindepth 1 -delete
    tar -C "${ROOTFS}" --numeric-owner -cf "${ROOTFS}.layer.tar" .
    cleanup_rootfs
    trap - EXIT
    pack_image "${PYTHON_IMAGE}" "${ROOTFS}.layer.tar" "${out}" \
      '{"Cmd":["python3"],"WorkingDir":"/","Env":["PATH='"${BASE_PATH}"'","LANG=C.UTF-8"]}'
    log "built ${PYTHON_IMAGE} in $((SECONDS - t0))s ($(du -m "${out}" | cut -f1) MB)"
  fi
  echo "${PYTHON_IMAGE} ${out}"
}

for image in "${wanted[@]}"; do
  "build_${image}"
done
