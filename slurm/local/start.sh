#!/usr/bin/env bash
# Start a local Slurm cluster on this machine without systemd (Debian 12, root).
# Used by the slurm test tier; also handy to try the sbatch templates on a laptop or CI box.
#
#   bash slurm/local/start.sh                      # one node on localhost, loopback only
#   VERL_SLURM_NODES=2 bash slurm/local/start.sh   # N nodes, each a separate host (see below)
#
# One node (the default): slurmctld and slurmd on localhost, everything bound to 127.0.0.1; the
# client commands (sbatch, srun, ...) run from this shell.
#
# N > 1 nodes: every Slurm host is a network namespace on a bridge this script creates
# ($VERL_SLURM_BRIDGE, 10.79.0.0/24, no address on this machine's side, no route out):
#   verl-ctl    10.79.0.2       slurmctld
#   verl-login  10.79.0.3       where client commands run: slurm/local/login.sh CMD ...
#   verl-nodeI  10.79.0.(10+I)  slurmd, with its own hostname (UTS namespace), its own /dev/shm and,
#                               unless the checkout is under /tmp, its own /tmp (mount namespace)
# The rest of the file system is shared, as a cluster's parallel file system is: keep job output
# out of /tmp (the checkout's outputs/, or $VERL_SLURM_DIR/shared). The CPUs are split between the
# nodes (nproc / N each, at least 1). The host names go into /etc/hosts (marked lines that stop.sh
# removes).
#
# Idempotent: installs missing packages, (re)writes slurm.conf, starts only daemons that are not
# running (restarts them if slurm.conf changed), then waits until every node is idle.
#
# Variables:
#   VERL_SLURM_NODES     number of nodes                          (default 1)
#   VERL_SLURM_DIR       state, spool, logs, pid files            (default /tmp/verl-local-slurm for one
#                        node; /var/lib/verl-local-slurm for N > 1: nodes have a private /tmp)
#   VERL_SLURM_CONF      slurm.conf path; /etc/slurm/slurm.conf is where srun/sbatch look without
#                        SLURM_CONF (default /etc/slurm/slurm.conf for one node; $VERL_SLURM_DIR/slurm.conf
#                        for N > 1, which login.sh exports as SLURM_CONF)
#   VERL_SLURM_CPUS      CPUs each node advertises                (default: nproc / N, at least 1)
#   VERL_SLURM_TIMEOUT   seconds to wait for the nodes to be idle (default 60)
#   VERL_SLURM_NO_INSTALL=1  never run apt-get
# Exit codes: 0 running; 1 failed to start; 2 bad variable; 3 packages missing and could not be installed.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=SCRIPTDIR/cluster.sh
source "$HERE/cluster.sh"
CPUS=${VERL_SLURM_CPUS:-$(($(nproc) / NODES > 0 ? $(nproc) / NODES : 1))}
TIMEOUT=${VERL_SLURM_TIMEOUT:-60}
NODE=localhost
PACKAGES=(slurmctld slurmd slurm-client munge openmpi-bin libopenmpi-dev)

say() { echo "[slurm/local/start] $*" >&2; }
pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# --- packages -------------------------------------------------------------------------------
missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  if [[ ${VERL_SLURM_NO_INSTALL:-0} == 1 ]]; then
    say "missing packages: ${missing[*]} (VERL_SLURM_NO_INSTALL=1, not installing)"; exit 3
  fi
  say "installing ${missing[*]}"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null; }; then
    say "cannot install ${missing[*]} with apt-get (no network or no Debian mirror)"; exit 3
  fi
fi

# --- loopback ---------------------------------------------------------------------------------
# With NoInAddrAny the daemons bind to what this host's name resolves to: it must be 127.x.
if ((NODES == 1)); then
  host=$(hostname)
  addr=$(getent ahostsv4 "$host" | awk 'NR == 1 {print $1}' || true)
  if [[ $addr != 127.* ]]; then
    say "hostname '$host' resolves to '${addr:-nothing}'; adding '127.0.0.1 $host' to /etc/hosts"
    echo "127.0.0.1 $host" >>/etc/hosts
  fi
fi

# --- munge ------------------------------------------------------------------------------------
mkdir -p "$STATE_DIR"/{state,spool,log}
[[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key --force
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge  # systemd-tmpfiles would create it
munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! munge_works; then
  say "starting munged"
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge_works && break; sleep 0.1; done
  munge_works || { say "munged did not start"; tail -5 /var/log/munge/munged.log >&2 || true; exit 1; }
fi

if ((NODES > 1)); then
  # shellcheck source=SCRIPTDIR/multinode.sh
  source "$HERE/multinode.sh"
  exit 0
fi

# --- slurm.conf -------------------------------------------------------------------------------
conf_text=$(cat <<EOF
# Written by slurm/local/start.sh: one node on localhost, loopback only, no accounting, no cgroups.
ClusterName=verl-local
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Bind to the address the host name resolves to (127.0.0.1), not to every interface.
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=pmix
ReturnToService=2
# Reject jobs that can never fit instead of letting them pend forever.
EnforcePartLimits=ALL
# Short ages so sbatch --wait, scancel and requeue return within seconds.
MinJobAge=5
KillWait=5
# A requeued job waits cred_expire + 1 s (default 120) before it may start again: the old run's
# credential must expire first. 30 s still covers a step launch on a loaded 2-core host. Forcing an
# earlier start (scontrol update StartTime=now) races the revocation and slurmd kills the job.
AuthInfo=cred_expire=30
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)
conf_changed=0
if [[ ! -f $CONF || "$(cat "$CONF")" != "$conf_text" ]]; then
  mkdir -p "$(dirname "$CONF")"
  printf '%s\n' "$conf_text" >"$CONF"
  conf_changed=1
  say "wrote $CONF"
fi
if [[ $CONF != /etc/slurm/slurm.conf ]]; then export SLURM_CONF=$CONF; fi

# --- daemons ----------------------------------------------------------------------------------
if ((conf_changed)) && { pid_alive "$STATE_DIR/slurmctld.pid" || pid_alive "$STATE_DIR/slurmd.pid"; }; then
  say "slurm.conf changed: restarting the daemons"
  VERL_SLURM_KEEP_MUNGE=1 "$(dirname "$0")/stop.sh"
fi
if ! pid_alive "$STATE_DIR/slurmctld.pid"; then
  say "starting slurmctld"
  slurmctld -c -f "$CONF"  # -c: clean state, no jobs left over from an earlier run
fi
if ! pid_alive "$STATE_DIR/slurmd.pid"; then
  say "starting slurmd"
  slurmd -N "$NODE" -f "$CONF"
fi

deadline=$((SECONDS + TIMEOUT))
while :; do
  state=$(sinfo -h -N -n "$NODE" -o %T 2>/dev/null || true)
  case $state in
    idle | mixed | allocated) break ;;
    down* | drain* | fail*) scontrol update nodename="$NODE" state=resume 2>/dev/null || true ;;
  esac
  if ((SECONDS >= deadline)); then
    say "node $NODE not idle after ${TIMEOUT}s (state '${state:-unknown}')"
    tail -n 20 "$STATE_DIR/log/slurmctld.log" "$STATE_DIR/log/slurmd.log" >&2 || true
    exit 1
  fi
  sleep 0.3
done
say "node $NODE is $state (slurmctld $(cat "$STATE_DIR/slurmctld.pid"), slurmd $(cat "$STATE_DIR/slurmd.pid"))"
