#!/usr/bin/env bash
# start.sh - install (if needed), configure and start a real Slurm cluster on
# this one host: a private munged, optionally MariaDB + slurmdbd (for sacct),
# slurmctld and N slurmd daemons that pose as N nodes (node1..nodeN), each with
# fake GPUs. Written for Debian 12 (Slurm 22.05), run as root, no systemd.
#
# Usage:  bash start.sh [STATE_DIR]     (default: $SLURM_LOCAL_STATE or /tmp/slurm-local)
#         export SLURM_CONF=STATE_DIR/etc/slurm.conf   (or: . STATE_DIR/env.sh)
# STATE_DIR must be reachable by the munge and mysql users (not under /root).
# /etc/slurm/slurm.conf is also linked to the config (see SLURM_LOCAL_LINK_ETC).
# Don't `eval "$(start.sh)"` under `set -e`: eval would hide a failed start.
#
# Idempotent: if the same cluster is already up it only prints the env line;
# a half-started or differently configured one is stopped (stop.sh) first.
# Progress and errors go to stderr; stdout gets only `export SLURM_CONF=...`.
#
# Settings (environment):
#   SLURM_LOCAL_NODES=8          slurmd daemons / nodes (node1..nodeN)
#   SLURM_LOCAL_SPARE_NODES=0    the last K nodes get a higher Weight: Slurm uses them only
#                                when the others are taken or excluded (node-failure retries)
#   SLURM_LOCAL_CPUS=8           CPUs declared per node (the host has fewer: fine)
#   SLURM_LOCAL_MEM_MB=16000     RealMemory declared per node
#   SLURM_LOCAL_GPUS=8           fake GPUs per node (0: no GRES at all)
#   SLURM_LOCAL_GPU_TYPE=        optional GPU type, e.g. h100 -> Gres=gpu:h100:8
#   SLURM_LOCAL_GPU_MKNOD=1      1: fake GPUs are character devices (mknod c 1 3),
#                                so jobs get CUDA_VISIBLE_DEVICES; 0 (or mknod
#                                refused): plain files - jobs still get
#                                SLURM_GPUS_ON_NODE but CUDA_VISIBLE_DEVICES is empty
#   SLURM_LOCAL_ACCOUNTING=1     1: MariaDB + slurmdbd so sacct works; 0: none
#   SLURM_LOCAL_PARTITIONS=debug space-separated partition names; first is default
#   SLURM_LOCAL_CLUSTER=local    ClusterName
#   SLURM_LOCAL_CTLD_PORT=6817   slurmctld port
#   SLURM_LOCAL_SLURMD_PORT_BASE=17000  node i's slurmd listens on BASE+i
#   SLURM_LOCAL_DBD_PORT=6819    slurmdbd port
#   SLURM_LOCAL_DB_PORT=16033    MariaDB port (bound to 127.0.0.1 only)
#   SLURM_LOCAL_MIN_JOB_AGE=3600 seconds a finished job stays in scontrol/squeue
#   SLURM_LOCAL_LINK_ETC=1       1: symlink /etc/slurm/slurm.conf to the rendered
#                                config so plain `sbatch` works without SLURM_CONF
#                                (only if that path is absent or already a symlink)
#   SLURM_LOCAL_INSTALL=1        0: never run apt-get; fail if packages are missing
#   SLURM_LOCAL_TIMEOUT=60       seconds to wait for each daemon
#   SLURM_LOCAL_KEEP_ON_FAILURE=0  1: leave daemons running if start fails
set -Eeuo pipefail

PROG="tests/slurm/start.sh"
HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)

info() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die()  { printf '%s: ERROR: %s\n' "$PROG" "$*" >&2; exit 1; }

# Any unexpected failing command: say where, and stop whatever was started.
on_error() {
  local rc=$? line=$1 cmd=$2
  trap - ERR
  printf '%s: ERROR: unexpected failure (exit %s) at line %s: %s\n' "$PROG" "$rc" "$line" "$cmd" >&2
  if [[ -n ${PIDS:-} && -s ${PIDS:-} && ${SLURM_LOCAL_KEEP_ON_FAILURE:-0} != 1 ]]; then
    printf '%s: stopping what was started\n' "$PROG" >&2
    SLURM_LOCAL_LOCK_HELD=1 bash "$HERE/stop.sh" "$STATE" >&2 || true
  fi
  exit 1
}
trap 'on_error $LINENO "$BASH_COMMAND"' ERR

usage() { sed -n '2,/^set -Eeuo/{/^set -Eeuo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }

case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  -*) die "unknown option: $1 (usage: start.sh [STATE_DIR])" ;;
esac
[[ $# -le 1 ]] || die "too many arguments (usage: start.sh [STATE_DIR])"

STATE=${1:-${SLURM_LOCAL_STATE:-/tmp/slurm-local}}
NODES=${SLURM_LOCAL_NODES:-8}
SPARE=${SLURM_LOCAL_SPARE_NODES:-0}
CPUS=${SLURM_LOCAL_CPUS:-8}
MEM=${SLURM_LOCAL_MEM_MB:-16000}
GPUS=${SLURM_LOCAL_GPUS:-8}
GPU_TYPE=${SLURM_LOCAL_GPU_TYPE:-}
GPU_MKNOD=${SLURM_LOCAL_GPU_MKNOD:-1}
ACCOUNTING=${SLURM_LOCAL_ACCOUNTING:-1}
PARTITIONS=${SLURM_LOCAL_PARTITIONS:-debug}
CLUSTER=${SLURM_LOCAL_CLUSTER:-local}
CTLD_PORT=${SLURM_LOCAL_CTLD_PORT:-6817}
SLURMD_PORT_BASE=${SLURM_LOCAL_SLURMD_PORT_BASE:-17000}
DBD_PORT=${SLURM_LOCAL_DBD_PORT:-6819}
DB_PORT=${SLURM_LOCAL_DB_PORT:-16033}
MIN_JOB_AGE=${SLURM_LOCAL_MIN_JOB_AGE:-3600}
LINK_ETC=${SLURM_LOCAL_LINK_ETC:-1}
INSTALL=${SLURM_LOCAL_INSTALL:-1}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}
KEEP_ON_FAILURE=${SLURM_LOCAL_KEEP_ON_FAILURE:-0}

# ---------------------------------------------------------------- checks
[[ $(id -u) -eq 0 ]] || die "must run as root (slurmd, munged and mknod need it)"
[[ $STATE == /* ]] || die "state dir must be an absolute path, got '$STATE'"
[[ $STATE != / && $STATE =~ ^/[A-Za-z0-9._/-]+$ ]] || die "state dir '$STATE' must be a plain path (letters, digits, . _ - /)"
STATE=${STATE%/}

isint() { [[ $2 =~ ^[0-9]+$ ]] || die "$1 must be a non-negative integer, got '$2'"; }
isint SLURM_LOCAL_NODES "$NODES"; isint SLURM_LOCAL_CPUS "$CPUS"; isint SLURM_LOCAL_MEM_MB "$MEM"
isint SLURM_LOCAL_GPUS "$GPUS"; isint SLURM_LOCAL_MIN_JOB_AGE "$MIN_JOB_AGE"; isint SLURM_LOCAL_TIMEOUT "$TIMEOUT"
for v in CTLD_PORT SLURMD_PORT_BASE DBD_PORT DB_PORT; do isint "SLURM_LOCAL_$v" "${!v}"; done
(( NODES >= 1 && NODES <= 128 )) || die "SLURM_LOCAL_NODES must be 1..128, got $NODES"
(( CPUS >= 1 )) || die "SLURM_LOCAL_CPUS must be >= 1"
(( MEM >= 100 )) || die "SLURM_LOCAL_MEM_MB must be >= 100"
(( GPUS <= 64 )) || die "SLURM_LOCAL_GPUS must be 0..64"
(( SLURMD_PORT_BASE + NODES <= 65535 )) || die "slurmd ports would pass 65535"
[[ $ACCOUNTING == 0 || $ACCOUNTING == 1 ]] || die "SLURM_LOCAL_ACCOUNTING must be 0 or 1"
[[ $GPU_MKNOD == 0 || $GPU_MKNOD == 1 ]] || die "SLURM_LOCAL_GPU_MKNOD must be 0 or 1"
[[ -z $GPU_TYPE || $GPU_TYPE =~ ^[A-Za-z0-9_]+$ ]] || die "SLURM_LOCAL_GPU_TYPE must be alphanumeric"
[[ $CLUSTER =~ ^[a-z0-9_]+$ ]] || die "SLURM_LOCAL_CLUSTER must be lowercase alphanumeric"
for p in $PARTITIONS; do [[ $p =~ ^[A-Za-z0-9_]+$ ]] || die "bad partition name '$p'"; done
[[ -n ${PARTITIONS// } ]] || die "SLURM_LOCAL_PARTITIONS is empty"
for f in slurm.conf.in slurmdbd.conf.in stop.sh; do
  [[ -r $HERE/$f ]] || die "missing $HERE/$f (keep start.sh next to its templates)"
done

CONF="$STATE/etc/slurm.conf"
PIDS="$STATE/pids"
LOG="$STATE/log"
MUNGE_SOCK="$STATE/munge/munge.socket.2"
T_START=$SECONDS

# Everything that describes the cluster's shape; a change restarts it cleanly.
PARAMS="nodes=$NODES spare=$SPARE cpus=$CPUS mem=$MEM gpus=$GPUS type=$GPU_TYPE mknod=$GPU_MKNOD acct=$ACCOUNTING parts=$PARTITIONS cluster=$CLUSTER ports=$CTLD_PORT,$SLURMD_PORT_BASE,$DBD_PORT,$DB_PORT minage=$MIN_JOB_AGE tmpl=$(cat "$HERE/slurm.conf.in" "$HERE/slurmdbd.conf.in" "${BASH_SOURCE[0]}" | md5sum | cut -c1-12)"

emit_env() { echo "export SLURM_CONF=$CONF"; }

# The binary a PID runs, with any " (deleted)" suffix (package upgraded) removed.
pid_exe() { local e; e=$(readlink "/proc/$1/exe" 2>/dev/null) || return 1; echo "${e% (deleted)}"; }

all_recorded_alive() {
  [[ -s $PIDS ]] || return 1
  local name pid exe
  while read -r name pid exe; do
    [[ -n $pid && $(pid_exe "$pid" || true) == "$exe" ]] || return 1
  done <"$PIDS"
}

# ---------------------------------------------------------------- lock + idempotency
mkdir -p "$STATE"
chmod 0755 "$STATE"
touch "$STATE/.slurm-local"          # marker: stop.sh --purge only deletes dirs with it
exec 9>"$STATE/.lock"
flock -w 300 9 || die "another start.sh/stop.sh holds $STATE/.lock"

if [[ -s $PIDS ]]; then
  if all_recorded_alive && [[ $(cat "$STATE/params" 2>/dev/null) == "$PARAMS" ]] \
     && SLURM_CONF=$CONF timeout 15 scontrol ping >/dev/null 2>&1; then
    info "cluster already running (state $STATE); nothing to do"
    emit_env
    exit 0
  fi
  info "found a stale, partial or differently configured cluster in $STATE: stopping it first"
  SLURM_LOCAL_LOCK_HELD=1 bash "$HERE/stop.sh" "$STATE" || die "stop.sh failed; see messages above"
fi
if [[ -f $STATE/params && $(cat "$STATE/params") != "$PARAMS" ]]; then
  info "cluster shape changed: discarding old controller state and accounting data (job ids restart at 1)"
  rm -rf "$STATE/ctld" "$STATE/spool" "$STATE/db/data"
fi
rm -f "$PIDS"

# ---------------------------------------------------------------- packages
PKGS=(munge slurmctld slurmd slurm-client)
(( ACCOUNTING )) && PKGS+=(slurmdbd mariadb-server)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
MADE_POLICY=0
cleanup_policy() { if (( MADE_POLICY )); then rm -f /usr/sbin/policy-rc.d; MADE_POLICY=0; fi; }
trap cleanup_policy EXIT
if (( ${#missing[@]} )); then
  (( INSTALL )) || die "packages not installed: ${missing[*]} (SLURM_LOCAL_INSTALL=0 forbids apt-get)"
  command -v apt-get >/dev/null || die "apt-get not found: this script targets Debian 12"
  mkdir -p "$LOG"
  # Keep package scripts from starting munge/slurm/mariadb services themselves.
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod 0755 /usr/sbin/policy-rc.d; MADE_POLICY=1
  fi
  info "installing ${missing[*]} (log: $LOG/apt.log)"
  t=$SECONDS
  export DEBIAN_FRONTEND=noninteractive
  apt-get -q -o DPkg::Lock::Timeout=300 update >>"$LOG/apt.log" 2>&1 \
    || { tail -n 20 "$LOG/apt.log" >&2; die "apt-get update failed (see $LOG/apt.log)"; }
  apt-get -q -y -o DPkg::Lock::Timeout=300 install --no-install-recommends "${missing[@]}" >>"$LOG/apt.log" 2>&1 \
    || { tail -n 20 "$LOG/apt.log" >&2; die "apt-get install failed (see $LOG/apt.log)"; }
  cleanup_policy
  info "packages installed in $((SECONDS - t))s"
fi
BINS=(/usr/sbin/munged /usr/bin/munge /usr/bin/unmunge /usr/sbin/slurmctld /usr/sbin/slurmd
      /usr/bin/sbatch /usr/bin/srun /usr/bin/squeue /usr/bin/scontrol /usr/bin/sinfo /usr/bin/setpriv)
(( ACCOUNTING )) && BINS+=(/usr/sbin/slurmdbd /usr/sbin/mariadbd /usr/bin/mariadb-install-db /usr/bin/mariadb
                           /usr/bin/mariadb-admin /usr/bin/sacct /usr/bin/sacctmgr)
for b in "${BINS[@]}"; do [[ -x $b ]] || die "$b not found after install"; done
id munge >/dev/null 2>&1 || die "user 'munge' missing (munge package broken?)"
(( ACCOUNTING )) && { id mysql >/dev/null 2>&1 || die "user 'mysql' missing (mariadb-server broken?)"; }
SLURM_VERSION=$(/usr/sbin/slurmd -V 2>/dev/null | awk '{print $2}' || true)
[[ $SLURM_VERSION == 22.05.* ]] || info "warning: written for Slurm 22.05, found '$SLURM_VERSION'"
if (( NODES > 1 )); then
  lib=$(ldd /usr/sbin/slurmd 2>/dev/null | awk '/libslurmfull/{print $3}')
  if [[ -n $lib && -r $lib ]] && ! grep -aq MULTIPLE_SLURMD "$lib"; then
    die "this Slurm build lacks --enable-multiple-slurmd, so one host cannot run $NODES slurmd; use SLURM_LOCAL_NODES=1"
  fi
fi

# ---------------------------------------------------------------- ports
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
ports=("$CTLD_PORT")
for ((i = 1; i <= NODES; i++)); do ports+=($((SLURMD_PORT_BASE + i))); done
(( ACCOUNTING )) && ports+=("$DBD_PORT" "$DB_PORT")
for p in "${ports[@]}"; do
  port_busy "$p" && die "port $p on 127.0.0.1 is already in use (see: ss -ltnp 'sport = :$p'); pick other SLURM_LOCAL_*PORT* values"
done
[[ $(printf '%s\n' "${ports[@]}" | sort | uniq -d) == "" ]] || die "port settings overlap: ${ports[*]}"

# ---------------------------------------------------------------- render config
umask 022
mkdir -p "$STATE"/{etc,ctld,log,run,dev,jobs}
for ((i = 1; i <= NODES; i++)); do mkdir -p "$STATE/spool/node$i"; done
chmod 0755 "$STATE/spool" "$STATE"/spool/*

if (( NODES == 1 )); then NODELIST=node1; PORTS=$((SLURMD_PORT_BASE + 1))
else NODELIST="node[1-$NODES]"; PORTS="[$((SLURMD_PORT_BASE + 1))-$((SLURMD_PORT_BASE + NODES))]"; fi

# Fake GPUs. Slurm 22.05 drops a gres/gpu that has no File= ("Removing file-less
# GPU"), and refuses the same file twice, so each GPU gets its own file:
# a character device with /dev/null's numbers (then slurmd sets
# CUDA_VISIBLE_DEVICES / SLURM_JOB_GPUS per job), or, where mknod is refused, a
# plain file (slurmd logs "not a valid character or block device" and jobs get
# SLURM_GPUS_ON_NODE but an empty CUDA_VISIBLE_DEVICES).
GPU_CHARDEV=$GPU_MKNOD
if (( GPUS > 0 )); then
  for ((g = 0; g < GPUS; g++)); do
    d="$STATE/dev/nvidia$g"
    if (( GPU_CHARDEV )); then
      [[ -c $d ]] && continue
      rm -f "$d"
      mknod -m 0666 "$d" c 1 3 2>/dev/null && continue
      info "warning: mknod refused; fake GPUs become plain files (no CUDA_VISIBLE_DEVICES in jobs)"
      GPU_CHARDEV=0
    fi
    [[ -f $d ]] || { rm -f "$d"; : >"$d"; }
  done
fi

DB_PASS=""
if (( ACCOUNTING )); then
  mkdir -p "$STATE/db"
  if [[ ! -s $STATE/db/slurm.pass ]]; then
    (umask 077; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$STATE/db/slurm.pass")
  fi
  DB_PASS=$(<"$STATE/db/slurm.pass")
fi

render() {  # render TEMPLATE > OUT
  sed -e "s#@STATE@#$STATE#g" -e "s#@CLUSTER@#$CLUSTER#g" -e "s#@CTLD_PORT@#$CTLD_PORT#g" \
      -e "s#@SLURMD_DEFAULT_PORT@#$((SLURMD_PORT_BASE + NODES + 1))#g" \
      -e "s#@DBD_PORT@#$DBD_PORT#g" -e "s#@DB_PORT@#$DB_PORT#g" -e "s#@DB_PASS@#$DB_PASS#g" \
      -e "s#@MIN_JOB_AGE@#$MIN_JOB_AGE#g" -e "s#@DEF_MEM_PER_CPU@#$((MEM / CPUS))#g" \
      -e "s#@JOBACCT_GATHER@#jobacct_gather/linux#g" "$1"
}
# The default slurmd port is unused (each node has its own) but must not clash.
port_busy $((SLURMD_PORT_BASE + NODES + 1)) && info "note: port $((SLURMD_PORT_BASE + NODES + 1)) (unused default SlurmdPort) is busy; harmless"

{
  render "$HERE/slurm.conf.in"
  echo
  echo "# ---- generated by start.sh ($PARAMS)"
  if (( ACCOUNTING )); then
    echo "AccountingStorageType=accounting_storage/slurmdbd"
    echo "AccountingStorageHost=localhost"
    echo "AccountingStoragePort=$DBD_PORT"
    # With auth/munge this names the munged socket used to talk to slurmdbd
    # (AuthInfo's socket= is not used for those connections).
    echo "AccountingStoragePass=$MUNGE_SOCK"
    (( GPUS > 0 )) && echo "AccountingStorageTRES=gres/gpu"
  else
    echo "AccountingStorageType=accounting_storage/none"
  fi
  gres=""
  if (( GPUS > 0 )); then
    echo "GresTypes=gpu"
    gres=" Gres=gpu:${GPU_TYPE:+$GPU_TYPE:}$GPUS"
  fi
  if (( SPARE > 0 && SPARE < NODES )); then
    for ((i = 1; i <= NODES; i++)); do
      weight=1; (( i > NODES - SPARE )) && weight=100
      echo "NodeName=node$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((SLURMD_PORT_BASE + i)) CPUs=$CPUS RealMemory=$MEM$gres Weight=$weight State=UNKNOWN"
    done
  else
    echo "NodeName=$NODELIST NodeHostname=localhost NodeAddr=127.0.0.1 Port=$PORTS CPUs=$CPUS RealMemory=$MEM$gres State=UNKNOWN"
  fi
  def=YES
  for p in $PARTITIONS; do
    echo "PartitionName=$p Nodes=ALL Default=$def MaxTime=INFINITE State=UP"
    def=NO
  done
} >"$CONF.new"
mv -f "$CONF.new" "$CONF"

if (( GPUS > 0 )); then
  if (( GPUS == 1 )); then files="$STATE/dev/nvidia0"; else files="$STATE/dev/nvidia[0-$((GPUS - 1))]"; fi
  echo "NodeName=$NODELIST Name=gpu${GPU_TYPE:+ Type=$GPU_TYPE} File=$files" >"$STATE/etc/gres.conf"
else
  rm -f "$STATE/etc/gres.conf"
fi
if (( ACCOUNTING )); then
  (umask 077; render "$HERE/slurmdbd.conf.in" >"$STATE/etc/slurmdbd.conf")
  chmod 0600 "$STATE/etc/slurmdbd.conf"
else
  rm -f "$STATE/etc/slurmdbd.conf"
fi
echo "$PARAMS" >"$STATE/params"
export SLURM_CONF="$CONF"      # inherited by the daemons (slurmdbd finds slurmdbd.conf next to it)

# ---------------------------------------------------------------- process helpers
fail() {
  printf '%s: ERROR: %s\n' "$PROG" "$1" >&2
  local f
  for f in "${@:2}"; do
    [[ -s $f ]] && { echo "----- last lines of $f" >&2; tail -n 25 "$f" >&2; }
  done
  if (( KEEP_ON_FAILURE )); then
    info "SLURM_LOCAL_KEEP_ON_FAILURE=1: leaving what started running; stop with: bash $HERE/stop.sh $STATE"
  else
    info "stopping what was started"
    SLURM_LOCAL_LOCK_HELD=1 bash "$HERE/stop.sh" "$STATE" >&2 || true
  fi
  exit 1
}

# launch NAME EXPECTED_EXE CMD... : start CMD detached (own session, stdio to
# $LOG/NAME.out), record "NAME PID EXE" in $PIDS, EXE with symlinks resolved as
# /proc/PID/exe shows it (stop.sh signals a PID only while it still runs EXE).
# The wrapper shell writes its own PID and then execs CMD, so the recorded PID
# is the daemon's whether or not setsid forked.
launch() {
  local name=$1 exe; shift
  exe=$(readlink -f "$1"); shift    # /usr/sbin/slurmd -> /usr/sbin/slurmd-wlm (alternatives)
  local pf="$STATE/run/launch-$name.pid" i pid
  rm -f "$pf"
  setsid bash -c 'echo $$ >"$0.tmp" && mv "$0.tmp" "$0" && exec "$@"' "$pf" "$@" \
    </dev/null >>"$LOG/$name.out" 2>&1 9>&- &
  for ((i = 0; i < 50; i++)); do [[ -s $pf ]] && break; sleep 0.1; done
  [[ -s $pf ]] || fail "could not launch $name" "$LOG/$name.out"
  pid=$(<"$pf")
  echo "$name $pid $exe" >>"$PIDS"
  LAUNCHED=$pid
}

# wait_until SECONDS WHAT PID LOGFILE CMD... : poll CMD until it succeeds.
wait_until() {
  local secs=$1 what=$2 pid=$3 logf=$4; shift 4
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if [[ -n $pid ]] && ! kill -0 "$pid" 2>/dev/null; then
      fail "$what: process $pid exited during startup" "$logf" "${logf%.out}.log"
    fi
    (( SECONDS < deadline )) || fail "timed out after ${secs}s waiting for $what" "$logf" "${logf%.out}.log"
    sleep 0.2
  done
}

# ---------------------------------------------------------------- munge
for u in munge $( (( ACCOUNTING )) && echo mysql); do
  setpriv --reuid="$u" --regid="$u" --clear-groups -- test -x "$STATE" 2>/dev/null \
    || die "user '$u' cannot reach $STATE (a parent directory lacks o+x, e.g. /root); use a state dir under /tmp"
done
install -d -o munge -g munge -m 0755 "$STATE/munge"
if [[ ! -s $STATE/munge/munge.key ]]; then
  (umask 077; dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none)
fi
chown munge:munge "$STATE/munge/munge.key"; chmod 0400 "$STATE/munge/munge.key"
launch munged /usr/sbin/munged \
  setpriv --reuid=munge --regid=munge --clear-groups -- \
  /usr/sbin/munged -F --socket="$MUNGE_SOCK" --key-file="$STATE/munge/munge.key" \
  --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" \
  --seed-file="$STATE/munge/munged.seed"
munge_ok() { munge -n --socket="$MUNGE_SOCK" | unmunge --socket="$MUNGE_SOCK"; }
wait_until "$TIMEOUT" "munged" "$LAUNCHED" "$LOG/munged.out" munge_ok
info "munged up (pid $LAUNCHED)"

# ---------------------------------------------------------------- accounting
if (( ACCOUNTING )); then
  DB="$STATE/db"
  chown mysql:mysql "$DB"; chmod 0750 "$DB"
  if [[ ! -d $DB/data/mysql ]]; then
    rm -rf "$DB/data"
    mariadb-install-db --no-defaults --user=mysql --datadir="$DB/data" \
      --auth-root-authentication-method=normal --skip-test-db >"$LOG/mariadb-install.log" 2>&1 \
      || fail "mariadb-install-db failed" "$LOG/mariadb-install.log"
  fi
  launch mariadb /usr/sbin/mariadbd \
    /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$DB/data" \
    --socket="$DB/mysqld.sock" --pid-file="$DB/mysqld.pid" --log-error="$DB/mariadb.err" \
    --bind-address=127.0.0.1 --port="$DB_PORT" --skip-name-resolve \
    --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 --innodb-log-file-size=64M
  wait_until "$TIMEOUT" "mariadbd" "$LAUNCHED" "$DB/mariadb.err" \
    mariadb-admin --no-defaults --socket="$DB/mysqld.sock" -uroot ping
  mariadb --no-defaults --socket="$DB/mysqld.sock" -uroot -e "
    CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
    ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
    FLUSH PRIVILEGES;" >>"$LOG/mariadb-setup.log" 2>&1 \
    || fail "could not create the slurm database user" "$LOG/mariadb-setup.log"
  info "mariadbd up (pid $LAUNCHED, 127.0.0.1:$DB_PORT)"

  launch slurmdbd /usr/sbin/slurmdbd /usr/sbin/slurmdbd -D
  wait_until "$TIMEOUT" "slurmdbd (port $DBD_PORT)" "$LAUNCHED" "$LOG/slurmdbd.out" port_busy "$DBD_PORT"
  info "slurmdbd up (pid $LAUNCHED)"
fi

# ---------------------------------------------------------------- slurmctld
launch slurmctld /usr/sbin/slurmctld /usr/sbin/slurmctld -D -f "$CONF"
wait_until "$TIMEOUT" "slurmctld" "$LAUNCHED" "$LOG/slurmctld.out" scontrol ping
info "slurmctld up (pid $LAUNCHED)"
if (( ACCOUNTING )); then
  cluster_registered() { sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER"; }
  wait_until "$TIMEOUT" "cluster '$CLUSTER' registered in slurmdbd" "" "$LOG/slurmdbd.out" cluster_registered
fi

# ---------------------------------------------------------------- slurmd x N
for ((i = 1; i <= NODES; i++)); do
  launch "slurmd-node$i" /usr/sbin/slurmd /usr/sbin/slurmd -D -N "node$i" -f "$CONF"
done
nodes_up() {
  local n
  n=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^(idle|mix|alloc|comp)$/' | sort -u | wc -l)
  [[ $n -eq $NODES ]]
}
deadline=$((SECONDS + TIMEOUT)); resumed=0
until nodes_up; do
  while read -r name pid exe; do
    [[ $name == slurmd-* ]] || continue
    kill -0 "$pid" 2>/dev/null || fail "$name (pid $pid) exited during startup" "$LOG/$name.out" "$LOG/$name.log"
  done <"$PIDS"
  # INVAL = slurmd reported less than slurm.conf declares (e.g. GRES): won't heal.
  inval=$(sinfo -h -N -o '%N %t' | awk '$2 ~ /^inval/{print $1}' | sort -u | paste -sd, -)
  if [[ -n $inval ]]; then
    fail "nodes $inval are INVALID: $(sinfo -h -N -o '%N: %E' -n "$inval" | sort -u | paste -sd';' -)" "$LOG/slurmctld.log"
  fi
  if (( !resumed && SECONDS > deadline - TIMEOUT / 2 )); then
    # Nodes left DOWN/DRAINED in the saved state by an earlier unclean stop.
    bad=$(sinfo -h -N -o '%N %t' | awk '$2 ~ /(down|drain|drng|fail)/{print $1}' | paste -sd, -)
    [[ -n $bad ]] && { info "resuming nodes $bad"; scontrol update NodeName="$bad" State=RESUME >/dev/null 2>&1 || true; }
    resumed=1
  fi
  (( SECONDS < deadline )) || fail "timed out after ${TIMEOUT}s waiting for $NODES nodes to be idle: $(sinfo -h -N -o '%N=%t' | paste -sd' ' -)" "$LOG/slurmctld.log"
  sleep 0.3
done
info "$NODES slurmd up: $(sinfo -h -o '%D nodes %t' | paste -sd, -)"

# Jobs recovered from the saved state of an earlier run that did not end through
# stop.sh (e.g. slurmctld was killed) would be requeued and run again: cancel them.
old_jobs=$(squeue -h -o %A 2>/dev/null | paste -sd' ' - || true)
if [[ -n $old_jobs ]]; then
  info "cancelling jobs left from an earlier run: $old_jobs"
  # shellcheck disable=SC2086
  scancel $old_jobs >/dev/null 2>&1 || true
fi

# Jobs that the database still shows as running but slurmctld no longer knows
# (left by a crash) would stay RUNNING in sacct forever: close them.
if (( ACCOUNTING )); then
  sacctmgr -i show runawayjobs >"$LOG/runawayjobs.log" 2>&1 || true
fi

# ---------------------------------------------------------------- finish
if (( LINK_ETC )); then
  if [[ -L /etc/slurm/slurm.conf || ! -e /etc/slurm/slurm.conf ]]; then
    mkdir -p /etc/slurm
    ln -sfn "$CONF" /etc/slurm/slurm.conf
  else
    info "note: /etc/slurm/slurm.conf is a real file; not replacing it - export SLURM_CONF=$CONF"
  fi
fi
cat >"$STATE/env.sh" <<EOF
# source this file to talk to the local cluster
export SLURM_CONF=$CONF
EOF
info "cluster '$CLUSTER' ready in $((SECONDS - T_START))s: $NODES nodes x $CPUS CPUs x ${GPUS} GPUs, accounting=$ACCOUNTING, state $STATE"
info "logs: $LOG   stop: bash $HERE/stop.sh $STATE"
emit_env
