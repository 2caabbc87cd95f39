#!/usr/bin/env bash
# A throwaway one-node SLURM cluster on this machine, to try workflow/profiles/slurm without a real cluster
# (and for tests/test_slurm.py). `make slurm-up` / `make slurm-down` call it.
#
#   tools/cluster/slurm_local.sh up       install slurm-wlm + munge if missing (apt, root), write a config for this
#                                   host (fake GPUs for scheduling only), start munged/slurmctld/slurmd, wait
#                                   until the node is idle. Does nothing if our cluster already runs.
#   tools/cluster/slurm_local.sh down     stop exactly the daemons `up` started (by the pids it recorded)
#   tools/cluster/slurm_local.sh status   exit 0 if our cluster answers with an idle/usable node
#   tools/cluster/slurm_local.sh env      print `export SLURM_CONF=...` for the shell that submits
#
# Everything lives in $ROUNDALIGN_SLURM_DIR (default /tmp/roundalign-slurm): slurm.conf, gres.conf, the two
# empty files that stand for GPUs, state, logs, and `pids` (name pid, one a line, only what we started).
# Clients find the config through SLURM_CONF=$ROUNDALIGN_SLURM_DIR/slurm.conf; if /etc/slurm/slurm.conf does
# not exist, `up` also links it there (and `down` removes that link), so plain `sinfo`/`sbatch` work too.
# Facts behind the settings: ../shared/design/slurm-local.md.
set -euo pipefail

STATE="${ROUNDALIGN_SLURM_DIR:-/tmp/roundalign-slurm}"
CONF="$STATE/slurm.conf"
PIDS="$STATE/pids"
ETC_CONF=/etc/slurm/slurm.conf

say() { echo "slurm-local: $*"; }
die() { echo "slurm-local: cannot $ACTION: $*" >&2; exit 2; }

# nproc obeys OMP_NUM_THREADS (the Makefile sets it to 1): count the cores without it
cores() { env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc; }

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

# pid recorded for a daemon name, if that process is still alive and still is that daemon
recorded_pid() {
    local name="$1" pid
    [ -f "$PIDS" ] || return 1
    pid=$(awk -v n="$name" '$1 == n {print $2}' "$PIDS" | tail -1)
    alive "$pid" || return 1
    [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$name" ] || return 1
    echo "$pid"
}

record() { echo "$1 $2" >>"$PIDS"; }

node_state() { SLURM_CONF="$CONF" sinfo -h -N -o %T 2>/dev/null | head -1 || true; }

write_config() {
    # $1: target directory. Prints nothing; writes slurm.conf and gres.conf there.
    local dir="$1" host cpus mem
    host=$(hostname -s)
    cpus=$(( $(cores) * 2 ))
    mem=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
    [ -n "$mem" ] || mem=$(free -m | awk '/^Mem:/ {print $2}')
    # leave a little memory to the OS so the node is never "low RealMemory" drained
    mem=$(( mem * 95 / 100 ))
    cat >"$dir/slurm.conf" <<EOF
# Written by tools/cluster/slurm_local.sh: a one-node test cluster. Throwaway; rewritten by every \`up\`.
ClusterName=roundalign-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# a job without --mem gets 1 GB, not the whole node
DefMemPerNode=1024
# the node offers twice its cores (slurmd accepts the configured count): test jobs mostly start Python or
# sleep, and a sleeping job should not hold back a sweep
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# jobs stay visible to squeue (the executor plugin's status command here) for MinJobAge seconds
MinJobAge=300
# a job that reaches its time limit is signalled at once and killed 5 s later (tests wait less)
OverTimeLimit=0
KillWait=5
InactiveLimit=0
SchedulerType=sched/backfill
GresTypes=gpu
NodeName=$host CPUs=$cpus RealMemory=$mem Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    # GPUs for scheduling only: without File= the node registers 0 GPUs and is drained
    cat >"$dir/gres.conf" <<EOF
AutoDetect=off
NodeName=$host Name=gpu File=$STATE/fakegpu[0-1]
EOF
}

need_root_and_tools() {
    [ "$(id -u)" = 0 ] || die "not root (it installs packages and runs slurmctld/slurmd/munged as root); run \`sudo make slurm-up\`"
    local missing=()
    for tool in munged munge unmunge slurmctld slurmd sbatch sinfo squeue scontrol; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        command -v apt-get >/dev/null \
            || die "missing ${missing[*]} and no apt-get to install them; install slurm-wlm and munge (SLURM >= 22.05) yourself"
        say "installing slurm-wlm and munge (missing: ${missing[*]})"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
    fi
}

start_munge() {
    if echo | munge 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0  # a munged answers (ours from an earlier `up`, or the system's): leave it as it is
    fi
    mkdir -p /etc/munge /var/log/munge /run/munge /var/lib/munge
    if [ ! -s /etc/munge/munge.key ]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown -R munge:munge /etc/munge /var/log/munge /run/munge /var/lib/munge
    chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
    rm -f /run/munge/munged.pid
    runuser -u munge -- munged --force --pid-file=/run/munge/munged.pid
    for _ in $(seq 50); do [ -s /run/munge/munged.pid ] && break; sleep 0.1; done
    record munged "$(cat /run/munge/munged.pid)"
    echo | munge | unmunge >/dev/null || die "munged started but munge/unmunge fail; see /var/log/munge/munged.log"
}

up() {
    need_root_and_tools
    mkdir -p "$STATE"
    local fresh
    fresh=$(mktemp -d)
    write_config "$fresh"
    if recorded_pid slurmctld >/dev/null && recorded_pid slurmd >/dev/null; then
        if cmp -s "$fresh/slurm.conf" "$CONF" && cmp -s "$fresh/gres.conf" "$STATE/gres.conf" \
                && [[ "$(node_state)" =~ ^(idle|mixed|allocated|completing) ]]; then
            rm -rf "$fresh"
            say "already up ($(node_state)); SLURM_CONF=$CONF"
            return 0
        fi
        say "our daemons run with another config or an unusable node: restarting them"
        down
    fi
    local other
    other=$(pgrep -x slurmctld || true)
    [ -z "$other" ] || die "a slurmctld that this script did not start runs (pid $other); stop it or use that cluster"
    other=$(pgrep -x slurmd || true)
    [ -z "$other" ] || die "a slurmd that this script did not start runs (pid $other); stop it or use that cluster"

    mv "$fresh/slurm.conf" "$fresh/gres.conf" "$STATE/" && rm -rf "$fresh"
    rm -rf "$STATE/ctld" "$STATE/slurmd"
    mkdir -p "$STATE/ctld" "$STATE/slurmd"
    : >"$STATE/fakegpu0"; : >"$STATE/fakegpu1"
    if [ ! -e "$ETC_CONF" ]; then
        mkdir -p "$(dirname "$ETC_CONF")"
        ln -s "$CONF" "$ETC_CONF"
        echo "$ETC_CONF" >"$STATE/etc-link"
    fi
    start_munge
    rm -f "$STATE/slurmctld.pid" "$STATE/slurmd.pid"
    SLURM_CONF="$CONF" slurmctld -f "$CONF" -i
    for _ in $(seq 100); do [ -s "$STATE/slurmctld.pid" ] && break; sleep 0.1; done
    alive "$(cat "$STATE/slurmctld.pid" 2>/dev/null)" || die "slurmctld did not start; see $STATE/slurmctld.log"
    record slurmctld "$(cat "$STATE/slurmctld.pid")"
    SLURM_CONF="$CONF" slurmd -f "$CONF"
    for _ in $(seq 100); do [ -s "$STATE/slurmd.pid" ] && break; sleep 0.1; done
    alive "$(cat "$STATE/slurmd.pid" 2>/dev/null)" || die "slurmd did not start; see $STATE/slurmd.log"
    record slurmd "$(cat "$STATE/slurmd.pid")"

    local state=""
    for i in $(seq 300); do
        state=$(node_state)
        [[ "$state" == idle* ]] && break
        if [[ "$state" =~ (drain|down|inval) ]] && [ $((i % 20)) = 0 ]; then
            SLURM_CONF="$CONF" scontrol update nodename="$(hostname -s)" state=resume 2>/dev/null || true
        fi
        sleep 0.1
    done
    [[ "$state" == idle* ]] || die "the node did not become idle (state '$state'); see $STATE/slurmctld.log and $STATE/slurmd.log"
    say "up: node $(hostname -s) idle, $(( $(cores) * 2 )) CPUs (2 per core), 2 fake GPUs; export SLURM_CONF=$CONF"
}

down() {
    if [ ! -f "$PIDS" ]; then
        say "nothing to stop (no $PIDS)"
        return 0
    fi
    # slurmd first, then the controller, then munged (if we started it)
    local name pid
    for name in slurmd slurmctld munged; do
        pid=$(recorded_pid "$name") || continue
        kill -TERM "$pid"
        for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
        if alive "$pid"; then kill -KILL "$pid"; fi
        say "stopped $name (pid $pid)"
    done
    rm -f "$PIDS"
    if [ -f "$STATE/etc-link" ]; then
        [ -L "$ETC_CONF" ] && [ "$(readlink "$ETC_CONF")" = "$CONF" ] && rm -f "$ETC_CONF"
        rm -f "$STATE/etc-link"
    fi
    rm -rf "$STATE/ctld" "$STATE/slurmd"
}

status() {
    recorded_pid slurmctld >/dev/null && recorded_pid slurmd >/dev/null || { say "down"; return 1; }
    local state
    state=$(node_state)
    say "node state: ${state:-no answer}; SLURM_CONF=$CONF"
    [[ "$state" =~ ^(idle|mixed|allocated|completing) ]]
}

ACTION="${1:-}"
case "$ACTION" in
    up) up ;;
    down) down ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up|down|status|env" >&2; exit 64 ;;
esac
