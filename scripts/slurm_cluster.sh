#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for tests and demos (Debian slurm-wlm + munge).
#   scripts/slurm_cluster.sh install   apt-get install slurm-wlm munge (needs root)
#   scripts/slurm_cluster.sh start DIR  write DIR/slurm.conf, start munged, slurmctld, slurmd; wait until idle
#   scripts/slurm_cluster.sh stop DIR   cancel jobs, stop the daemons started from DIR
# After `start`, use the cluster with: export SLURM_CONF=DIR/slurm.conf
# proctrack/linuxproc and task/none need no cgroups, so this works inside containers and sandboxes.
set -euo pipefail

cmd=${1:?usage: $0 install|start DIR|stop DIR}
dir=${2:-}

case "$cmd" in
install)
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
    ;;
start)
    [ -n "$dir" ] || { echo "usage: $0 start DIR" >&2; exit 2; }
    mkdir -p "$dir"/{spool,state,log}
    dir=$(cd "$dir" && pwd)
    host=$(hostname -s)
    cpus=$(nproc)
    mem_mb=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024))
    # munge: a key, and /run/munge owned by the munge user
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    fi
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/lib/munge /var/log/munge && chown munge:munge /run/munge /var/lib/munge /var/log/munge
    pgrep -x munged >/dev/null || runuser -u munge -- munged
    cat >"$dir/slurm.conf" <<EOF
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
SlurmctldPort=6817
SlurmdPort=6818
KillWait=5
InactiveLimit=0
MinJobAge=300
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF="$dir/slurm.conf"
    # daemons left by an earlier cluster (a crashed test run) would hold the ports: this is a test cluster
    pkill -x slurmctld 2>/dev/null || true
    pkill -x slurmd 2>/dev/null || true
    sleep 1
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
    scancel --user="$(id -un)" 2>/dev/null || true
    for daemon in slurmd slurmctld; do
        if [ -s "$dir/$daemon.pid" ]; then
            kill "$(cat "$dir/$daemon.pid")" 2>/dev/null || true
        fi
    done
    sleep 2
    # job steps that ignored the cancel, and daemons that outlived their pid files
    pkill -9 -x slurmstepd 2>/dev/null || true
    for daemon in slurmd slurmctld; do
        [ -s "$dir/$daemon.pid" ] && kill -9 "$(cat "$dir/$daemon.pid")" 2>/dev/null || true
    done
    ;;
*)
    echo "usage: $0 install|start DIR|stop DIR" >&2
    exit 2
    ;;
esac
