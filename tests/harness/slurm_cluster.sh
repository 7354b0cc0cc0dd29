#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests/test_slurm.py (and for trying
# `apiary launch launcher=slurm` by hand). Root only; Debian/Ubuntu (apt) to install.
#
#   tests/harness/slurm_cluster.sh up       install slurm-wlm + munge if missing, write the config,
#                                           start munged, slurmctld, slurmd; wait until the node is idle
#   tests/harness/slurm_cluster.sh down     stop the three daemons by their pid files
#   tests/harness/slurm_cluster.sh status   whether they run, and the node's state
#
# Everything lives under $SLURM_TEST_DIR (default /tmp/slurm-test): slurm.conf, the munge key and
# socket, run/*.pid, log/*.log, the controller's state and slurmd's spool. Clients need
# SLURM_CONF=$SLURM_TEST_DIR/slurm.conf (tests/test_slurm.py sets it). Ports: $SLURM_TEST_PORT
# (controller, default 16817) and the next one (slurmd), away from a real cluster's 6817/6818.
#
# Exit codes: 0 done; 1 a daemon did not start or the node did not become idle (the logs' tails are
# printed); 3 this machine cannot run it (not root, no apt-get, the install failed): the test skips.
set -uo pipefail

DIR=${SLURM_TEST_DIR:-/tmp/slurm-test}
PORT=${SLURM_TEST_PORT:-16817}
CONF=$DIR/slurm.conf
NODE=$(hostname -s)
MUNGE_SOCKET=$DIR/munge/munge.socket

say() { echo "slurm_cluster: $*"; }
cannot() { say "$*"; exit 3; }

alive() {  # alive PIDFILE: the process named there runs
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_if_missing() {
    local missing=()
    command -v munged >/dev/null || missing+=(munge)
    for b in slurmctld slurmd sbatch; do command -v "$b" >/dev/null || { missing+=(slurm-wlm); break; }; done
    [ ${#missing[@]} -eq 0 ] && return 0
    command -v apt-get >/dev/null || cannot "${missing[*]} not installed and no apt-get here (install Slurm and munge by hand)"
    say "installing ${missing[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y --no-install-recommends "${missing[@]}" >"$DIR/log/apt.log" 2>&1; then
        apt-get update >>"$DIR/log/apt.log" 2>&1 || true
        apt-get install -y --no-install-recommends "${missing[@]}" >>"$DIR/log/apt.log" 2>&1 ||
            cannot "apt-get install ${missing[*]} failed (no network or no such package?): $(tail -n 3 "$DIR/log/apt.log" | tr '\n' ' ')"
    fi
}

write_config() {
    # the node as slurmd sees this machine (CPUs, sockets, cores, threads, memory), so it registers
    # without being drained for a resource mismatch
    local hw
    hw=$(slurmd -C 2>/dev/null | grep '^NodeName=' | sed "s/^NodeName=[^ ]*/NodeName=$NODE/")
    [ -n "$hw" ] || hw="NodeName=$NODE CPUs=$(nproc)"
    cat >"$CONF" <<EOF
# written by tests/harness/slurm_cluster.sh: one node, no accounting, no cgroups
ClusterName=apiary-test
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
SlurmctldTimeout=30
SlurmdTimeout=60
$hw NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
    alive "$DIR/run/munged.pid" && return 0
    if [ ! -s "$DIR/munge/munge.key" ]; then
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
        chmod 0400 "$DIR/munge/munge.key"
    fi
    # --force: the folders are root's under /tmp, which munged would otherwise call insecure
    munged --force --key-file="$DIR/munge/munge.key" --socket="$MUNGE_SOCKET" \
        --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" \
        || { say "munged did not start"; tail -n 20 "$DIR/log/munged.log" 2>/dev/null; exit 1; }
}

node_state() {
    SLURM_CONF=$CONF sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n 1
}

up() {
    [ "$(id -u)" = 0 ] || cannot "needs root (the daemons run as root); not root here"
    mkdir -p "$DIR"/{run,log,state,spool,munge}
    chmod 0700 "$DIR/munge"
    install_if_missing
    if alive "$DIR/run/slurmctld.pid" && alive "$DIR/run/slurmd.pid" && alive "$DIR/run/munged.pid"; then
        say "already up ($CONF)"
    else
        down quiet
        write_config
        start_munge
        SLURM_CONF=$CONF slurmctld -i -f "$CONF" || { say "slurmctld did not start"; tail -n 30 "$DIR/log/slurmctld.log"; exit 1; }
        SLURM_CONF=$CONF slurmd -f "$CONF" -N "$NODE" || { say "slurmd did not start"; tail -n 30 "$DIR/log/slurmd.log"; exit 1; }
    fi
    local state="" i
    for i in $(seq 1 60); do
        state=$(node_state)
        case "$state" in
            idle*|mixed*|allocated*) say "node $NODE is $state; export SLURM_CONF=$CONF"; return 0 ;;
            down*|drain*) SLURM_CONF=$CONF scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 ;;
        esac
        sleep 1
    done
    say "node $NODE did not become idle in 60 s (state: ${state:-unknown})"
    tail -n 30 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" 2>/dev/null
    exit 1
}

stop() {  # stop PIDFILE NAME: TERM, then KILL after 20 s
    local f=$1 pid i
    alive "$f" || { rm -f "$f"; return 0; }
    pid=$(cat "$f")
    kill -TERM "$pid" 2>/dev/null
    for i in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    rm -f "$f"
    [ "${3:-}" = quiet ] || say "stopped $2 (pid $pid)"
}

down() {
    stop "$DIR/run/slurmd.pid" slurmd "${1:-}"
    stop "$DIR/run/slurmctld.pid" slurmctld "${1:-}"
    stop "$DIR/run/munged.pid" munged "${1:-}"
}

status() {
    local f
    for f in munged slurmctld slurmd; do
        if alive "$DIR/run/$f.pid"; then say "$f runs (pid $(cat "$DIR/run/$f.pid"))"; else say "$f is not running"; fi
    done
    [ -f "$CONF" ] && say "node $NODE: $(node_state || true)"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
