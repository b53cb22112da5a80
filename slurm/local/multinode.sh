# shellcheck shell=bash
# The N > 1 part of slurm/local/start.sh (sourced after packages and munge): the bridge, one network
# namespace per host, slurm.conf, slurmctld on verl-ctl and one slurmd per verl-nodeI.
REPO_ROOT=$(cd "$HERE/../.." && pwd)
mkdir -p "$STATE_DIR"/{state,log,shared}
chmod 1777 "$STATE_DIR/shared"
NODE_NAMES=()
for i in $(seq 1 "$NODES"); do NODE_NAMES+=("$NODE_PREFIX$i"); done

# --- hosts -------------------------------------------------------------------------------------
if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
  say "creating bridge $BRIDGE"
  # No address on this machine's side: only the namespaced hosts talk over it.
  ip link add "$BRIDGE" type bridge
  ip link set "$BRIDGE" up
fi
add_host() {  # name address: a namespace with eth0 on the bridge, and an /etc/hosts line
  local name=$1 addr=$2
  if ! [[ -e /run/netns/$name ]]; then
    ip netns add "$name"
    ip link add "vh-$name" type veth peer name eth0 netns "$name"
    ip link set "vh-$name" master "$BRIDGE" up
    ip -n "$name" addr add "$addr/24" dev eth0
    ip -n "$name" link set eth0 up
    ip -n "$name" link set lo up
  fi
  grep -qE "^${addr}[[:space:]]+${name}[[:space:]]" /etc/hosts || echo "$addr $name $HOSTS_MARK" >>/etc/hosts
}
add_host "$CTL_HOST" "$CTL_ADDR"
add_host "$LOGIN_HOST" "$LOGIN_ADDR"
for i in $(seq 1 "$NODES"); do add_host "${NODE_NAMES[i - 1]}" "$(node_addr "$i")"; done

# --- slurm.conf -------------------------------------------------------------------------------
node_lines=
for i in $(seq 1 "$NODES"); do
  node_lines+="NodeName=${NODE_NAMES[i - 1]} NodeAddr=$(node_addr "$i") CPUs=$CPUS State=UNKNOWN"$'\n'
done
conf_text=$(cat <<CONF
# Written by slurm/local/start.sh: $NODES nodes, each a network namespace on bridge $BRIDGE.
ClusterName=verl-local-multi
SlurmctldHost=$CTL_HOST($CTL_ADDR)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Every daemon and srun binds the address its host name resolves to, not every interface.
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE_DIR/state
# %n: the node name, so that several slurmd share this file system.
SlurmdSpoolDir=$STATE_DIR/spool.%n
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.%n.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=pmix
ReturnToService=2
EnforcePartLimits=ALL
MinJobAge=5
KillWait=5
# A node that stops answering is DOWN after this long, and its jobs end (requeued with --requeue).
SlurmdTimeout=30
AuthInfo=cred_expire=30
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
${node_lines}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
)
conf_changed=0
if [[ ! -f $CONF || "$(cat "$CONF")" != "$conf_text" ]]; then
  mkdir -p "$(dirname "$CONF")"
  printf '%s\n' "$conf_text" >"$CONF"
  conf_changed=1
  say "wrote $CONF"
fi
printf 'SLURM_CONF=%s\nVERL_SLURM_NODES=%s\n' "$CONF" "$NODES" >"$STATE_DIR/cluster.env"

# --- daemons ----------------------------------------------------------------------------------
any_alive=0
for pidfile in "$STATE_DIR"/slurmctld.pid "$STATE_DIR"/slurmd.*.pid; do pid_alive "$pidfile" && any_alive=1; done
if ((conf_changed && any_alive)); then
  say "slurm.conf changed: restarting the daemons"
  VERL_SLURM_KEEP_MUNGE=1 VERL_SLURM_KEEP_HOSTS=1 bash "$HERE/stop.sh"
fi
if ! pid_alive "$STATE_DIR/slurmctld.pid"; then
  say "starting slurmctld on $CTL_HOST"
  # shellcheck disable=SC2016  # $1, $2: the inner shell's arguments
  # nsenter --net, not `ip netns exec`: that remounts /sys and hides the cgroup mounts slurmd needs.
  nsenter --net="/run/netns/$CTL_HOST" unshare --uts \
    bash -c 'hostname "$1" && exec slurmctld -c -f "$2"' ctl "$CTL_HOST" "$CONF"
fi
checkout_in_tmp=""
case $REPO_ROOT/ in /tmp/*) checkout_in_tmp=$REPO_ROOT ;; esac  # bound back into the node's own /tmp
for name in "${NODE_NAMES[@]}"; do
  pid_alive "$STATE_DIR/slurmd.$name.pid" && continue
  say "starting slurmd on $name"
  # shellcheck disable=SC2016
  # Own hostname, /dev/shm and /tmp: mounts made in a private mount namespace vanish with it. A checkout
  # under /tmp stays visible to the jobs: bound aside, the node's /tmp mounted, then bound back (Open MPI's
  # PMIx keeps per-job sockets in /tmp: two nodes sharing it fail to launch a step across them).
  nsenter --net="/run/netns/$name" unshare --uts --mount --propagation private bash -c '
    hostname "$1" && mount -t tmpfs -o size=4g,mode=1777 tmpfs /dev/shm &&
    keep=/dev/shm/.verl-checkout &&
    if [[ -n $3 ]]; then mkdir -p "$keep" && mount --bind "$3" "$keep"; fi &&
    mount -t tmpfs -o mode=1777 tmpfs /tmp &&
    if [[ -n $3 ]]; then mkdir -p "$3" && mount --bind "$keep" "$3" && umount "$keep" && rmdir "$keep"; fi &&
    exec slurmd -N "$1" -f "$2"' \
    node "$name" "$CONF" "$checkout_in_tmp"
done

deadline=$((SECONDS + TIMEOUT))
while :; do
  states=$(nsenter --net="/run/netns/$LOGIN_HOST" env SLURM_CONF="$CONF" sinfo -h -N -o '%N %T' 2>/dev/null || true)
  not_ready=$(awk '$2 !~ /^(idle|mixed|allocated)$/' <<<"$states")
  [[ -n $states && -z $not_ready ]] && break
  while read -r node state; do
    case $state in
      down* | drain* | fail*)
        nsenter --net="/run/netns/$LOGIN_HOST" env SLURM_CONF="$CONF" \
          scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
    esac
  done <<<"$not_ready"
  if ((SECONDS >= deadline)); then
    say "nodes not idle after ${TIMEOUT}s: ${states:-no answer from slurmctld}"
    tail -n 20 "$STATE_DIR"/log/*.log >&2 || true
    exit 1
  fi
  sleep 0.3
done
say "$NODES nodes up (${NODE_NAMES[*]}, $CPUS CPUs each); client commands: slurm/local/login.sh CMD ..."
