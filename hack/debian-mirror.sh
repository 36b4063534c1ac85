#!/usr/bin/env bash
# Print the Debian mirror (archive URI) the image builds should use for SUITE (default bookworm):
#
#   hack/debian-mirror.sh [SUITE]
#
# ROLLOUT_DEBIAN_MIRROR wins when set. Otherwise the first `deb` source of this machine's apt
# configuration that serves SUITE with component main: /etc/apt/sources.list,
# /etc/apt/sources.list.d/*.list (one-line format) and /etc/apt/sources.list.d/*.sources
# (deb822). Security and -updates/-backports suites do not count (debootstrap needs the main
# archive). Exits 1 with a message when nothing matches: there is no built-in address.
set -euo pipefail
suite="${1:-bookworm}"
if [[ -n "${ROLLOUT_DEBIAN_MIRROR:-}" ]]; then
  echo "${ROLLOUT_DEBIAN_MIRROR%/}"
  exit 0
fi
etc="${ROLLOUT_APT_ETC:-/etc/apt}"   # (for tests of this script)

# One-line format: deb [options] URI SUITE COMPONENT...
from_list() { # file
  local line uri s rest
  while read -r line; do
    line="${line%%#*}"
    [[ "${line}" =~ ^[[:space:]]*deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+)[[:space:]]+([^[:space:]]+)[[:space:]]+(.*)$ ]] \
      || continue
    uri="${BASH_REMATCH[2]}" s="${BASH_REMATCH[3]}" rest=" ${BASH_REMATCH[4]} "
    [[ "${s%/}" == "${suite}" && "${rest}" == *" main "* ]] || continue
    echo "${uri%/}"
    return 0
  done <"$1"
  return 1
}

# deb822 format: stanzas separated by blank lines; Types, URIs, Suites, Components, Enabled.
from_sources() { # file
  awk -v suite="${suite}" '
    function flush() {
      if (types ~ /(^| )deb( |$)/ && enabled != "no" && (" " suites " ") ~ (" " suite "/? ") \
          && (" " comps " ") ~ / main / && uris != "") {
        split(uris, u, " "); print u[1]; found = 1; exit
      }
      types = uris = suites = comps = ""; enabled = "yes"; key = ""
    }
    BEGIN { enabled = "yes" }
    /^[[:space:]]*#/ { next }
    /^[[:space:]]*$/ { flush(); next }
    /^[[:space:]]/ { if (key == "uris") uris = uris " " $0; next }   # continuation line
    {
      k = tolower($0); sub(/:.*/, "", k); v = $0; sub(/^[^:]*:[[:space:]]*/, "", v)
      gsub(/[[:space:]]+/, " ", v); key = k
      if (k == "types") types = v; else if (k == "uris") uris = v
      else if (k == "suites") suites = v; else if (k == "components") comps = v
      else if (k == "enabled") enabled = tolower(v)
    }
    END { if (!found) flush(); if (!found) exit 1 }
  ' "$1" | sed 's#/*$##'
  return "${PIPESTATUS[0]}"
}

files=()
[[ -f "${etc}/sources.list" ]] && files+=("${etc}/sources.list")
for f in "${etc}"/sources.list.d/*.list "${etc}"/sources.list.d/*.sources; do
  [[ -f "${f}" ]] && files+=("${f}")
done
for f in "${files[@]}"; do
  case "${f}" in
    *.sources) out="$(from_sources "${f}")" || continue ;;
    *) out="$(from_list "${f}")" || continue ;;
  esac
  [[ -n "${out}" ]] && { echo "${out}"; exit 0; }
done
echo "debian-mirror: no apt source for '${suite}' (main) in ${etc}/sources.list{,.d/*.list,.d/*.sources};" \
  "set ROLLOUT_DEBIAN_MIRROR=http://<mirror>/debian" >&2
exit 1
