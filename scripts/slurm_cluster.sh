#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for tests and demos (Debian slurm-wlm + munge).
#   scripts/slurm_cluster.sh install   apt-get install slurm-wlm munge (needs root)
#   scripts/slurm_cluster.sh start DIR  write DIR/slurm.conf, start munged (unless one runs), slurmctld, slurmd
#                                       on free ports; wait until the node is idle
#   scripts/slurm_cluster.sh stop DIR   cancel the cluster's jobs, stop the daemons this DIR's start started
# After `start`, use the cluster with: export SLURM_CONF=DIR/slurm.conf
# proctrack/linuxproc and task/none need no cgroups, so this works inside containers and sandboxes.
# Every daemon is stopped by the pid that its start recorded in DIR: other clusters and daemons on the
# machine (another user's, another test's) are never touched.
set -euo pipefail

cmd=${1:?usage: $0 install|start DIR|stop DIR}
dir=${2:-}

# stop_pid FILE NAME: TERM the process in FILE if it is still NAME, KILL it after 10 s
stop_pid() {
    local file=$1 name=$2 pid
    [ -s "$file" ] || return 0
    pid=$(cat "$file")
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] || return 0
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 20); do
        [ -d "/proc/$pid" ] || return 0
        sleep 0.5
    done
    kill -9 "$pid" 2>/dev/null || true
}

case "$cmd" in
install)
    DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
    ;;
start)
    [ -n "$dir" ] || { echo "usage: $0 start DIR" >&2; exit 2; }
    mkdir -p "$dir"/{spool,state,log}
    dir=$(cd "$dir" && pwd)
    host=$(hostname -s)
    cpus=$(nproc)
    mem_mb=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024))
    # two free TCP ports, so that daemons of another cluster on this machine keep theirs
    read -r ctld_port slurmd_port < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("", 0))
print(*(s.getsockname()[1] for s in socks))')
    # munge: reuse a munged that already answers; otherwise start one and record its pid for `stop`
    if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        if [ ! -s /etc/munge/munge.key ]; then
            mkdir -p /etc/munge
            dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
        fi
        chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
        mkdir -p /run/munge /var/lib/munge /var/log/munge && chown munge:munge /run/munge /var/lib/munge /var/log/munge
        runuser -u munge -- munged
        cp /run/munge/munged.pid "$dir/munged.pid"
    fi
    cat >"$dir/slurm.conf" <<CONF
ClusterName=kvbench
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmdSpoolDir=$dir/spool
StateSaveLocation=$dir/state
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
KillWait=5
InactiveLimit=0
MinJobAge=300
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
    export SLURM_CONF="$dir/slurm.conf"
    slurmctld -c
    slurmd -c
    for _ in $(seq 60); do
        if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            echo "SLURM cluster up: export SLURM_CONF=$SLURM_CONF"
            exit 0
        fi
        sleep 1
    done
    echo "SLURM cluster did not come up; logs in $dir/log" >&2
    exit 1
    ;;
stop)
    [ -n "$dir" ] || { echo "usage: $0 stop DIR" >&2; exit 2; }
    export SLURM_CONF="$dir/slurm.conf"
    jobs=$(squeue -h -o %A 2>/dev/null || true)
    if [ -n "$jobs" ]; then
        # shellcheck disable=SC2086
        scancel $jobs 2>/dev/null || true
        for _ in $(seq 20); do
            [ -z "$(squeue -h -o %A 2>/dev/null || true)" ] && break
            sleep 0.5
        done
    fi
    stop_pid "$dir/slurmd.pid" slurmd
    # job steps of this cluster that outlived the cancel: the step daemons holding files under DIR
    for pid in $(pgrep -x slurmstepd || true); do
        if ls -l "/proc/$pid/fd" 2>/dev/null | grep -q -- "-> $dir/"; then
            echo "$pid" >"$dir/slurmstepd.pid"
            stop_pid "$dir/slurmstepd.pid" slurmstepd
        fi
    done
    stop_pid "$dir/slurmctld.pid" slurmctld
    stop_pid "$dir/munged.pid" munged
    ;;
*)
    echo "usage: $0 install|start DIR|stop DIR" >&2
    exit 2
    ;;
esac
