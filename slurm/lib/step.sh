# shellcheck shell=bash
# The job step and what follows it, shared by slurm/multinode_cpu.sbatch and slurm/ppo_multinode_gpu.sbatch
# (sourced, not run). `verl_run_step TAG CMD SRUN_ARGS...` runs CMD on every task under srun and returns its exit
# code in $rc, handling what can happen to a batch job on the way:
#
# - Preemption or the time limit (SIGUSR1 to the batch shell, from `--signal=B:USR1@N` or `scancel --batch
#   --signal=USR1`): forwarded to the tasks (srun relays it), which finish the step, checkpoint and exit 0; the
#   job then requeues itself (up to VERL_MAX_REQUEUES restarts) and the next run resumes.
# - SIGTERM to the batch shell (`scancel`, or Slurm preempting with PreemptMode=CANCEL/REQUEUE): forwarded as a
#   checkpoint request the same way, but the job does not requeue itself (a cancel means stop; a preempting Slurm
#   requeues on its own). The tasks must finish within the cluster's KillWait, after which Slurm kills them.
# - The time limit, with a lead derived from the run's own measurements: a timer reads the job's end time and
#   signals the shell when the time left drops below launch/preemption_lead.py's lead (the longest step plus the
#   longest checkpoint save measured in VERL_METRICS_FILE, with a safety factor and margin), so a run whose steps
#   or checkpoints outgrow the header's --signal lead still checkpoints before Slurm kills it.
# - A failed task: srun --kill-on-bad-exit=1 ends the step; if srun waits on a task whose slurmstepd died with it
#   (srun never hears of its exit), a watchdog ends srun VERL_FAILURE_GRACE_S seconds after the first failure line.
#   The script then prints one line naming the node and rank that failed first.
#
# Variables: VERL_VENV (its python runs the lead calculator), VERL_MAX_REQUEUES (default 10),
# VERL_FAILURE_GRACE_S (default 20), VERL_METRICS_FILE (default: none, the timer then uses the minimum lead),
# VERL_PREEMPT_LEAD_MIN_S (default 0: the header's --signal lead covers the unmeasured case),
# VERL_PREEMPT_MARGIN_S (default 60), VERL_PREEMPT_FACTOR (default 1.5), VERL_PREEMPT_POLL_S (default 30).

_verl_say() { echo "[$_verl_tag] $*"; }

# shellcheck disable=SC2317,SC2329  # reached through the traps set in verl_run_step
_verl_forward() {
  # One request reaches the tasks: a second signal (Slurm's own --signal after the deadline timer's, which Slurm
  # may send up to a minute early) only updates what happens after the step; relayed, it would reach ranks that
  # are already exiting after their checkpoint, with the default action (killed, exit 138).
  local first=$((_verl_preempted == 0 && _verl_terminated == 0))
  if [[ $1 == TERM ]]; then
    _verl_terminated=1
    _verl_say "SIGTERM: asking the tasks to checkpoint and stop"
  else
    _verl_preempted=1
    _verl_say "preemption signal: asking the tasks to checkpoint and stop"
  fi
  # srun relays SIGUSR1 to every task of the step; the ranks treat it as a checkpoint request.
  if ((first)) && [[ -n $_verl_step_pid ]]; then kill -USR1 "$_verl_step_pid" 2>/dev/null || true; fi
}

# Seconds since the epoch at which the job's time limit ends; empty when it has none or Slurm does not say.
_verl_job_end_epoch() {
  local end
  end=$(squeue -h -j "${SLURM_JOB_ID:-0}" -o %e 2>/dev/null | head -n 1)
  [[ $end =~ ^[0-9]{4}- ]] || return 0
  date -d "$end" +%s 2>/dev/null || true
}

# The deadline timer: signals this shell (USR1) once the time left is below the measured lead.
_verl_deadline_timer() {
  local shell_pid=$1 end now lead
  end=$(_verl_job_end_epoch)
  [[ -n $end ]] || exit 0
  while :; do
    lead=$("$VERL_VENV/bin/python" "$_verl_lead_script" --metrics "${VERL_METRICS_FILE:-}" \
      --minimum "${VERL_PREEMPT_LEAD_MIN_S:-0}" --margin "${VERL_PREEMPT_MARGIN_S:-60}" \
      --factor "${VERL_PREEMPT_FACTOR:-1.5}" 2>/dev/null) || lead=${VERL_PREEMPT_LEAD_MIN_S:-0}
    now=$(date +%s)
    if ((now + ${lead%.*} >= end)); then
      _verl_say "$((end - now))s left of the time limit, below the measured lead of ${lead}s (step + checkpoint):" \
        "checkpointing now"
      kill -USR1 "$shell_pid" 2>/dev/null
      exit 0
    fi
    sleep "${VERL_PREEMPT_POLL_S:-30}"
  done
}

# After the first failure srun normally ends the step within seconds. It waits forever for a task whose
# slurmstepd died with it (srun never hears of its exit): end srun after a grace period.
_verl_failure_watchdog() {
  local step_pid=$1 failures=$2 grace=${VERL_FAILURE_GRACE_S:-20}
  while kill -0 "$step_pid" 2>/dev/null && [[ ! -s $failures ]]; do sleep 1; done
  for _ in $(seq "$grace"); do kill -0 "$step_pid" 2>/dev/null || exit 0; sleep 1; done
  if kill -0 "$step_pid" 2>/dev/null; then
    echo "[$_verl_tag] srun is still waiting ${grace}s after the first failure: ending the step" >&2
    kill -TERM "$step_pid" 2>/dev/null; sleep 5; kill -KILL "$step_pid" 2>/dev/null
  fi
}

# One line naming the node and rank that failed first, from srun's and gloo's/NCCL's lines.
_verl_report_failure() {
  local failures=$1 tasks_per_node=$2 task_line peer lost node='' ranks='' why='' index host
  sleep 0.2  # the filter's last line
  task_line=$(grep -m 1 '^srun: error' "$failures" || true)
  # gloo names the peer it lost: "Connection closed by peer [IP]:port", "Read error [IP]:port: ... reset by peer".
  peer=$(grep -m 1 -E ' by peer' "$failures" | grep -m 1 -oE '\[[0-9.]+\]:[0-9]+' | grep -oE '[0-9.]+[0-9]\]' |
    tr -d ']' || true)
  if [[ $task_line =~ ^srun:\ error:\ ([^:]+):\ tasks?\ ([0-9,-]+):\ (.*)$ ]]; then
    node=${BASH_REMATCH[1]} ranks=${BASH_REMATCH[2]} why=${BASH_REMATCH[3]}
  fi
  # A rank that merely lost its peer exits 1 too, and may be the first srun hears of (its peer's slurmstepd
  # died with it): then the peer's host is where the failure started.
  if [[ -n $peer && ( -z $node || $why == "Exited with exit code 1" ) ]]; then
    index=0
    for host in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
      if [[ $(getent ahostsv4 "$host" | awk 'NR == 1 {print $1}') == "$peer" && $host != "$node" ]]; then
        why="its ranks went away; rank(s) ${ranks:-?} on ${node:-?} lost the connection"
        node=$host ranks=$((index * tasks_per_node))
        ((tasks_per_node > 1)) && ranks+="-$(((index + 1) * tasks_per_node - 1))"
        break
      fi
      index=$((index + 1))
    done
  fi
  # Or rank 0 names the ranks it lost at the rollout barrier (verl.single_controller.generation_wait): tasks are
  # placed in blocks of tasks_per_node, so rank r ran on the (r / tasks_per_node)-th node of the job.
  lost=$(grep -m 1 -oE 'lost rank\(s\) \[[0-9]+' "$failures" | grep -oE '[0-9]+$' || true)
  if [[ -z $peer && -n $lost && ( -z $node || $why == "Exited with exit code 1" ) ]]; then
    index=$((lost / tasks_per_node))
    host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n "$((index + 1))p")
    if [[ -n $host && $host != "$node" ]]; then
      why="its ranks went away; rank(s) ${ranks:-?} on ${node:-?} lost rank ${lost}"
      node=$host ranks=$((index * tasks_per_node))
      ((tasks_per_node > 1)) && ranks+="-$(((index + 1) * tasks_per_node - 1))"
    fi
  fi
  if [[ -n $node ]]; then
    echo "[$_verl_tag] failed: node $node rank $ranks ($why); exit $rc" >&2
  else
    echo "[$_verl_tag] failed: exit $rc (no task reported the first failure; see the ranks' lines above)" >&2
  fi
}

# verl_run_step TAG CMD TASKS_PER_NODE SRUN_ARGS...: sets rc to the step's exit code.
verl_run_step() {
  _verl_tag=$1
  local cmd=$2 tasks_per_node=$3 failures watchdog timer
  shift 3
  _verl_lead_script=${SLURM_SUBMIT_DIR:-$PWD}/launch/preemption_lead.py
  _verl_preempted=0 _verl_terminated=0 _verl_step_pid=
  trap '_verl_forward USR1' USR1
  trap '_verl_forward TERM' TERM
  # The step's stderr (srun's and the ranks') goes through a filter that keeps the lines saying who failed.
  failures=$(mktemp)
  srun --kill-on-bad-exit=1 "$@" bash -c "exec ${cmd}" 2> >(tee -a /dev/stderr |
    grep --line-buffered -E '^srun: error: [^:]+: tasks? [0-9]| by peer|lost rank\(s\) \[' >"$failures") &
  _verl_step_pid=$!
  _verl_failure_watchdog "$_verl_step_pid" "$failures" &
  watchdog=$!
  _verl_deadline_timer $$ &
  timer=$!
  while :; do  # a trapped signal interrupts `wait`: keep waiting until the step has ended
    rc=0
    wait "$_verl_step_pid" || rc=$?
    kill -0 "$_verl_step_pid" 2>/dev/null || break
  done
  kill "$watchdog" "$timer" 2>/dev/null || true
  _verl_say "step finished with exit code $rc"
  if ((rc != 0)); then _verl_report_failure "$failures" "$tasks_per_node"; fi
  rm -f "$failures"

  if ((_verl_terminated)) && ((rc == 0)); then
    _verl_say "checkpoint written; not requeueing (SIGTERM: a cancel stops the job, a preempting Slurm requeues it)"
  elif ((_verl_preempted)) && ((rc == 0)); then
    if ((${SLURM_RESTART_COUNT:-0} < ${VERL_MAX_REQUEUES:-10})); then
      _verl_say "checkpoint written; requeueing job ${SLURM_JOB_ID} to resume"
      scontrol requeue "$SLURM_JOB_ID"
    else
      _verl_say "checkpoint written; not requeueing: ${SLURM_RESTART_COUNT:-0} restarts reached VERL_MAX_REQUEUES"
    fi
  fi
}
