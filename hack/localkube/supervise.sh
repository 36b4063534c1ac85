#!/usr/bin/env bash
# The local cluster's process supervisor: restarts a component that exits, with a back-off, the
# way a kubelet restarts static Pods. Started by `cluster.sh up` (one per cluster, detached),
# stopped by `cluster.sh down`; not meant to be run by hand.
#
#   hack/localkube/supervise.sh SUPERVISOR_DIR
#
# SUPERVISOR_DIR/<component>/ describes one supervised process (written by cluster.sh/node.sh
# from the running process right after starting it):
#   argv      its command line (NUL-separated)     environ  its environment (NUL-separated)
#   cwd       its working directory                log      file its output is appended to
#   pidfile   path of the file holding its PID (kwokctl's pids/<name>.pid for the control plane)
# A component whose process is gone is started again from those files after a back-off that
# doubles from LOCALKUBE_RESTART_BACKOFF_MIN (1 s) up to LOCALKUBE_RESTART_BACKOFF_MAX (30 s) and
# falls back to the minimum once it has run LOCALKUBE_RESTART_RESET (60 s). Each restart is
# logged (SUPERVISOR_DIR/../logs/supervisor.log, and a line in the component's own log) and
# counted in SUPERVISOR_DIR/<component>/restarts. A stopped (SIGSTOP) process is alive: it is
# never restarted. SUPERVISOR_DIR/.lock is held while restarting, so whoever removes a component
# (node-down) under that lock never races a restart. Exits on SIGTERM, or when SUPERVISOR_DIR is
# deleted (the cluster is gone).
set -uo pipefail
SUP="${1:?usage: supervise.sh SUPERVISOR_DIR}"
MIN="${LOCALKUBE_RESTART_BACKOFF_MIN:-1}"
MAX="${LOCALKUBE_RESTART_BACKOFF_MAX:-30}"
RESET="${LOCALKUBE_RESTART_RESET:-60}"
TICK="${LOCALKUBE_SUPERVISOR_TICK:-1}"

log() { printf '[supervisor %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
trap 'log "stopping (SIGTERM)"; exit 0' TERM INT

declare -A backoff=() next_start=() started_at=()

# PID of component dir $1 when that process is alive and is still the recorded command.
alive_pid() {
  local d="$1" pid want have
  pid="$(tr -dc '0-9' 2>/dev/null <"$(cat "${d}/pidfile" 2>/dev/null)")" || return 1
  [[ -n "${pid}" && -r "/proc/${pid}/cmdline" ]] || return 1
  want="$(tr '\0' ' ' 2>/dev/null <"${d}/argv")" || return 1
  have="$(tr '\0' ' ' 2>/dev/null <"/proc/${pid}/cmdline")" || return 1
  [[ "${have}" == "${want}" ]] || return 1
  # A zombie (exited, not yet reaped by its parent) is not alive.
  [[ "$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "/proc/${pid}/status" 2>/dev/null)" != Z ]] \
    || return 1
  echo "${pid}"
}

start_component() { # dir name
  local d="$1" name="$2" argv=() envs=() cwd logf pid
  mapfile -d '' -t argv <"${d}/argv"
  mapfile -d '' -t envs <"${d}/environ"
  cwd="$(cat "${d}/cwd")"; logf="$(cat "${d}/log")"
  ((${#argv[@]})) || { log "${name}: empty argv; not restarting"; return 1; }
  printf '\n[supervisor %s] restarting %s (exited; restart #%s)\n' "$(date +%H:%M:%S)" \
    "${name}" "$(($(cat "${d}/restarts" 2>/dev/null || echo 0) + 1))" >>"${logf}"
  # Own session, no inherited descriptors besides the log, same environment and directory.
  (cd "${cwd}" && exec setsid env -i "${envs[@]}" "${argv[@]}" </dev/null >>"${logf}" 2>&1 \
    6>&- 7>&- 8>&- 9>&-) &
  pid=$!
  # No newline: kwokctl parses its pid files with strconv.Atoi.
  printf '%s' "${pid}" >"$(cat "${d}/pidfile")"
  echo $(($(cat "${d}/restarts" 2>/dev/null || echo 0) + 1)) >"${d}/restarts"
  log "${name}: restarted as pid ${pid} (back-off was ${backoff[${name}]:-${MIN}}s; log ${logf})"
}

check_once() {
  local d name now=${SECONDS} pid
  for d in "${SUP}"/*/; do
    d="${d%/}"; name="${d##*/}"
    [[ -f "${d}/argv" && -f "${d}/pidfile" ]] || continue
    if pid="$(alive_pid "${d}")"; then
      # Running long enough: the next crash starts from the minimum back-off again.
      if [[ -n "${started_at[${name}]:-}" ]] && ((now - started_at[${name}] >= RESET)); then
        backoff[${name}]=${MIN}; unset "started_at[${name}]"
      fi
      continue
    fi
    if [[ -z "${next_start[${name}]:-}" ]]; then
      local wait=${backoff[${name}]:-${MIN}}
      next_start[${name}]=$((now + wait))
      log "${name}: process gone (pid file $(cat "${d}/pidfile")); restarting in ${wait}s"
      continue
    fi
    ((now >= next_start[${name}])) || continue
    # Under the lock: the component may have been removed meanwhile (node-down).
    exec 6>>"${SUP}/.lock"
    flock 6
    if [[ -f "${d}/argv" ]] && ! alive_pid "${d}" >/dev/null; then
      start_component "${d}" "${name}" || true
      started_at[${name}]=${SECONDS}
      local b=$(( ${backoff[${name}]:-${MIN}} * 2 ))
      ((b <= MAX)) || b=${MAX}
      backoff[${name}]=${b}
    fi
    exec 6>&-
    unset "next_start[${name}]"
  done
}

log "supervising ${SUP} (pid $$; back-off ${MIN}s..${MAX}s, reset after ${RESET}s)"
echo $$ >"${SUP}/supervisor.pid"
while [[ -d "${SUP}" ]]; do
  check_once
  # (bash reaps restarted children that exit; alive_pid treats a zombie as gone anyway.)
  sleep "${TICK}" & wait $!
done
log "${SUP} is gone; exiting"
