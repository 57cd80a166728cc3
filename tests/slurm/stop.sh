#!/usr/bin/env bash
# stop.sh - stop the local Slurm cluster that start.sh started, by PID.
#
# Usage:  stop.sh [--purge] [STATE_DIR]   (default: $SLURM_LOCAL_STATE or /tmp/slurm-local)
#
# 1. cancels every job still queued or running (if slurmctld answers);
# 2. sends SIGTERM to the daemons recorded in STATE_DIR/pids, stage by stage
#    (slurmd's, slurmctld, slurmdbd, mariadbd, munged), each PID checked against
#    the binary it was recorded with so a reused PID is never signalled, and
#    SIGKILL after SLURM_LOCAL_STOP_TIMEOUT (30) seconds;
# 3. stops leftovers of this cluster only: processes running a Slurm/munge/MariaDB
#    binary whose command line, SLURM_CONF or open files point into STATE_DIR
#    (e.g. the slurmstepd of a job that could not be cancelled because slurmctld
#    had died), and the job processes below such a slurmstepd (SIGKILL after 5s);
# 4. removes /etc/slurm/slurm.conf if it is start.sh's symlink into STATE_DIR.
# --purge then deletes STATE_DIR (config, logs, job state, database).
# Idempotent: stopping a stopped cluster, or a missing STATE_DIR, is fine.
set -Eeuo pipefail

PROG="tests/slurm/stop.sh"
info() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die()  { printf '%s: ERROR: %s\n' "$PROG" "$*" >&2; exit 1; }

PURGE=0
ARGS=()
for a in "$@"; do
  case "$a" in
    --purge) PURGE=1 ;;
    -h|--help) sed -n '2,/^set -Eeuo/{/^set -Eeuo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) die "unknown option: $a (usage: stop.sh [--purge] [STATE_DIR])" ;;
    *) ARGS+=("$a") ;;
  esac
done
[[ ${#ARGS[@]} -le 1 ]] || die "too many arguments (usage: stop.sh [--purge] [STATE_DIR])"
STATE=${ARGS[0]:-${SLURM_LOCAL_STATE:-/tmp/slurm-local}}
STOP_TIMEOUT=${SLURM_LOCAL_STOP_TIMEOUT:-30}
[[ $STOP_TIMEOUT =~ ^[0-9]+$ ]] || die "SLURM_LOCAL_STOP_TIMEOUT must be an integer"

[[ $(id -u) -eq 0 ]] || die "must run as root"
[[ $STATE == /* && $STATE != / ]] || die "state dir must be an absolute path other than /, got '$STATE'"
STATE=${STATE%/}
if [[ ! -d $STATE ]]; then info "no state dir $STATE: nothing to stop"; exit 0; fi
[[ -f $STATE/.slurm-local ]] || die "refusing: $STATE has no .slurm-local marker (not made by start.sh)"
if [[ ${SLURM_LOCAL_LOCK_HELD:-0} != 1 ]]; then
  exec 9>"$STATE/.lock"
  flock -w 300 9 || die "another start.sh/stop.sh holds $STATE/.lock"
fi

CONF="$STATE/etc/slurm.conf"
PIDS="$STATE/pids"
# Binaries of this cluster's processes, symlinks (Debian alternatives) resolved.
OUR_BINS=" "
for b in /usr/sbin/slurmd /usr/sbin/slurmctld /usr/sbin/slurmdbd /usr/sbin/slurmstepd /usr/sbin/munged /usr/sbin/mariadbd; do
  [[ -e $b ]] && OUR_BINS+="$(readlink -f "$b") "
done

pid_exe() { local e; e=$(readlink "/proc/$1/exe" 2>/dev/null) || return 1; echo "${e% (deleted)}"; }

label_of() { (tr '\0' ' ' <"/proc/$1/cmdline" | cut -c1-40 | tr ' ' '_') 2>/dev/null || true; }

# recorded NAME-GLOB: lines "name pid" of recorded, still-running daemons.
recorded() {
  [[ -s $PIDS ]] || return 0
  local name pid exe
  while read -r name pid exe; do
    # shellcheck disable=SC2053
    [[ $name == $1 ]] || continue
    [[ $(pid_exe "$pid" || true) == "$exe" ]] && echo "$name $pid"
  done <"$PIDS"
  return 0
}

# stop_pids LABEL "name pid"...: SIGTERM all, wait, SIGKILL survivors.
# The wait is $STOP_WAIT seconds (default SLURM_LOCAL_STOP_TIMEOUT).
FAILED=0
stop_pids() {
  local label=$1; shift
  (( $# )) || return 0
  local wait_s=${STOP_WAIT:-$STOP_TIMEOUT}
  local -A exe_of=()
  local entry name pid
  for entry in "$@"; do
    name=${entry% *}; pid=${entry##* }
    exe_of[$pid]=$(pid_exe "$pid" || true)
    kill -TERM "$pid" 2>/dev/null && info "SIGTERM $name (pid $pid)"
  done
  local deadline=$((SECONDS + wait_s)) left
  while :; do
    left=()
    for pid in "${!exe_of[@]}"; do
      [[ $(pid_exe "$pid" || true) == "${exe_of[$pid]}" ]] && left+=("$pid")
    done
    (( ${#left[@]} )) || return 0
    (( SECONDS < deadline )) || break
    sleep 0.2
  done
  for pid in "${left[@]}"; do
    info "$label pid $pid still running after ${wait_s}s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  done
  local i alive
  for ((i = 0; i < 50; i++)); do      # up to 10s for the kernel to finish them
    alive=0
    for pid in "${left[@]}"; do [[ $(pid_exe "$pid" || true) == "${exe_of[$pid]}" ]] && alive=1; done
    (( alive )) || return 0
    sleep 0.2
  done
  for pid in "${left[@]}"; do
    if [[ $(pid_exe "$pid" || true) == "${exe_of[$pid]}" ]]; then
      info "ERROR: pid $pid ($(label_of "$pid")) survived SIGKILL (state $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null))"; FAILED=1
    fi
  done
}

# ---------------------------------------------------------------- 1. cancel jobs
if [[ -n $(recorded slurmctld) && -r $CONF ]] && SLURM_CONF=$CONF timeout 10 scontrol ping >/dev/null 2>&1; then
  jobs=$(SLURM_CONF=$CONF timeout 15 squeue -h -o %A 2>/dev/null | paste -sd' ' - || true)
  if [[ -n $jobs ]]; then
    info "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    SLURM_CONF=$CONF timeout 15 scancel $jobs >/dev/null 2>&1 || true
    deadline=$((SECONDS + 30))
    while [[ -n $(SLURM_CONF=$CONF timeout 10 squeue -h -o %A 2>/dev/null || true) ]] && (( SECONDS < deadline )); do
      sleep 0.5
    done
  fi
fi

# ---------------------------------------------------------------- 2. daemons
for stage in 'slurmd-*' slurmctld slurmdbd mariadb munged; do
  mapfile -t found < <(recorded "$stage")
  stop_pids "$stage" "${found[@]}"
done

# ---------------------------------------------------------------- 3. leftovers
belongs_here() {  # PID: is this a process of the cluster in $STATE?
  local p=$1 f
  [[ $OUR_BINS == *" $(pid_exe "$p" || echo none) "* ]] || return 1
  [[ $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null) == *"$STATE/"* ]] && return 0
  tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$CONF" && return 0
  for f in /proc/"$p"/fd/*; do
    [[ $(readlink "$f" 2>/dev/null) == "$STATE/"* ]] && return 0
  done
  return 1
}
leftovers=(); stepds=()
declare -A kids=()                  # ppid -> "child child ..."
STEPD_EXE=$(readlink -f /usr/sbin/slurmstepd 2>/dev/null || echo none)
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  [[ $p == "$$" ]] && continue
  st=$(cat "$d/stat" 2>/dev/null) || continue
  read -r _ ppid _ <<<"${st##*) }"
  kids[$ppid]+=" $p"
  belongs_here "$p" || continue
  leftovers+=("$(label_of "$p") $p")
  [[ $(pid_exe "$p" || true) == "$STEPD_EXE" ]] && stepds+=("$p")
done
if (( ${#stepds[@]} )); then
  # The job processes under an orphaned slurmstepd: the batch script, srun, tasks.
  tasks=(); todo=("${stepds[@]}")
  while (( ${#todo[@]} )); do
    p=${todo[0]}; todo=("${todo[@]:1}")
    for c in ${kids[$p]:-}; do tasks+=("$(label_of "$c") $c"); todo+=("$c"); done
  done
  if (( ${#tasks[@]} )); then
    info "stopping ${#tasks[@]} job process(es) left under slurmstepd"
    STOP_WAIT=5 stop_pids job-process "${tasks[@]}"
  fi
fi
if (( ${#leftovers[@]} )); then
  info "stopping ${#leftovers[@]} leftover process(es) of this cluster"
  STOP_WAIT=$(( ${#stepds[@]} ? 5 : STOP_TIMEOUT )) stop_pids leftover "${leftovers[@]}"
fi

# ---------------------------------------------------------------- 4. files
if [[ -L /etc/slurm/slurm.conf && $(readlink /etc/slurm/slurm.conf) == "$CONF" ]]; then
  rm -f /etc/slurm/slurm.conf
fi
rm -f "$PIDS" "$STATE"/run/launch-*.pid

if (( FAILED )); then die "some processes could not be stopped; state dir left in place"; fi
if (( PURGE )); then
  rm -rf -- "$STATE"
  info "stopped and purged $STATE"
else
  info "stopped (state kept in $STATE; --purge deletes it)"
fi
