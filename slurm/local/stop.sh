#!/usr/bin/env bash
# Stop the one-node cluster started by slurm/local/start.sh. Idempotent.
# Cancels every job first (a job's slurmstepd outlives a stopped slurmd), then stops slurmd,
# slurmctld and munged by the pids in their pid files, and waits until each is gone.
#
# Variables: VERL_SLURM_DIR (as in start.sh); VERL_SLURM_KEEP_MUNGE=1 leaves munged running;
#            VERL_SLURM_PURGE=1 also deletes the state and spool directories.
set -uo pipefail

STATE_DIR=${VERL_SLURM_DIR:-/tmp/verl-local-slurm}
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

if pid_alive "$STATE_DIR/slurmctld.pid"; then
  mapfile -t jobs < <(squeue -h -o %i 2>/dev/null)
  if ((${#jobs[@]})); then
    say "cancelling jobs ${jobs[*]}"
    scancel "${jobs[@]}"
    for _ in $(seq 60); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.5; done
  fi
fi
stop_by_pidfile slurmd "$STATE_DIR/slurmd.pid"
stop_by_pidfile slurmctld "$STATE_DIR/slurmctld.pid"
if [[ ${VERL_SLURM_KEEP_MUNGE:-0} != 1 ]]; then stop_by_pidfile munged /run/munge/munged.pid; fi
if [[ ${VERL_SLURM_PURGE:-0} == 1 ]]; then rm -rf "$STATE_DIR/state" "$STATE_DIR/spool"; fi
exit 0
