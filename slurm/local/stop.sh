#!/usr/bin/env bash
# Stop the cluster started by slurm/local/start.sh. Idempotent: safe to run twice, or with nothing running.
# Cancels every job first (a job's slurmstepd outlives a stopped slurmd), then stops slurmd, slurmctld
# and munged by the pids in their pid files, and waits until each is gone. A multi-node cluster's
# hosts go too: what still runs in their namespaces, the namespaces (their /dev/shm and /tmp mounts
# vanish with them), the veth links, the bridge and the /etc/hosts lines start.sh added.
#
# Variables: VERL_SLURM_NODES (as in start.sh): 1 or unset stops the one-node cluster and any multi-node
#            one; N > 1 stops only the multi-node cluster. VERL_SLURM_DIR (as in start.sh);
#            VERL_SLURM_KEEP_MUNGE=1 leaves munged running; VERL_SLURM_PURGE=1 also deletes the state
#            and spool directories (always done for a multi-node cluster's hosts).
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=SCRIPTDIR/cluster.sh
source "$HERE/cluster.sh"
say() { echo "[slurm/local/stop] $*" >&2; }
pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_by_pidfile() {  # name pidfile
  local name=$1 pidfile=$2 pid
  if ! pid_alive "$pidfile"; then rm -f "$pidfile"; return 0; fi
  pid=$(cat "$pidfile")
  say "stopping $name (pid $pid)"
  kill -TERM "$pid"
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    say "$name still running after 10 s: SIGKILL"
    kill -KILL "$pid"
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  fi
  rm -f "$pidfile"
}

cancel_all_jobs() {  # client command prefix...
  local jobs
  mapfile -t jobs < <("$@" squeue -h -o %i 2>/dev/null)
  ((${#jobs[@]})) || return 0
  say "cancelling jobs ${jobs[*]}"
  "$@" scancel "${jobs[@]}"
  for _ in $(seq 60); do [[ -z $("$@" squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.5; done
}

stop_multi_node() {
  local dir=$MULTI_DIR conf ns pidfile hosts=()
  conf=$(sed -n 's/^SLURM_CONF=//p' "$dir/cluster.env" 2>/dev/null)
  if [[ -n $conf && -e /run/netns/$LOGIN_HOST ]] && pid_alive "$dir/slurmctld.pid"; then
    cancel_all_jobs nsenter --net="/run/netns/$LOGIN_HOST" env SLURM_CONF="$conf"
  fi
  for pidfile in "$dir"/slurmd.*.pid; do
    [[ -e $pidfile ]] && stop_by_pidfile "slurmd ${pidfile#"$dir"/slurmd.}" "$pidfile"
  done
  stop_by_pidfile slurmctld "$dir/slurmctld.pid"
  for ns in /run/netns/"$CTL_HOST" /run/netns/"$LOGIN_HOST" /run/netns/"$NODE_PREFIX"*; do
    [[ -e $ns ]] && hosts+=("${ns#/run/netns/}")
  done
  for ns in "${hosts[@]}"; do
    # Whatever still runs on the host (a job step cut off from its node): these are the cluster's own.
    local pids
    mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null)
    if ((${#pids[@]})); then
      say "killing what still runs on $ns: ${pids[*]}"
      kill -KILL "${pids[@]}" 2>/dev/null
      for _ in $(seq 50); do [[ -z $(ip netns pids "$ns" 2>/dev/null) ]] && break; sleep 0.1; done
    fi
    ip link del "vh-$ns" 2>/dev/null
    ip netns del "$ns" 2>/dev/null && say "removed host $ns"
  done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE" && say "removed bridge $BRIDGE"; fi
  if [[ ${VERL_SLURM_KEEP_HOSTS:-0} != 1 ]] && grep -qF "$HOSTS_MARK" /etc/hosts; then
    # In place (not sed -i's rename): /etc/hosts may be a bind mount.
    local kept
    kept=$(grep -vF "$HOSTS_MARK" /etc/hosts)
    printf '%s\n' "$kept" >/etc/hosts
  fi
  rm -rf "$dir"/spool.* "$dir/state"
}

stop_multi_node
if ((NODES == 1)); then
  if pid_alive "$STATE_DIR/slurmctld.pid"; then cancel_all_jobs env; fi
  stop_by_pidfile slurmd "$STATE_DIR/slurmd.pid"
  stop_by_pidfile slurmctld "$STATE_DIR/slurmctld.pid"
  if [[ ${VERL_SLURM_PURGE:-0} == 1 ]]; then rm -rf "$STATE_DIR/state" "$STATE_DIR/spool"; fi
fi
# munged serves both clusters: it stays while either one still runs.
one_node_dir=${VERL_SLURM_DIR:-/tmp/verl-local-slurm}
if [[ ${VERL_SLURM_KEEP_MUNGE:-0} != 1 ]] && ! pid_alive "$one_node_dir/slurmctld.pid" \
    && ! pid_alive "$MULTI_DIR/slurmctld.pid"; then
  stop_by_pidfile munged /run/munge/munged.pid
fi
exit 0
