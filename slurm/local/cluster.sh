# shellcheck shell=bash disable=SC2034  # the variables are for the scripts that source this
# Names shared by start.sh, stop.sh and login.sh (sourced, not run): where the cluster keeps its state
# and, for N > 1 nodes, its hosts. Reads VERL_SLURM_NODES, VERL_SLURM_DIR, VERL_SLURM_CONF.
NODES=${VERL_SLURM_NODES:-1}
if [[ ! $NODES =~ ^[1-9][0-9]*$ ]] || ((NODES > 50)); then
  echo "[slurm/local] VERL_SLURM_NODES: expected a whole number in [1, 50], found '$NODES'" >&2
  exit 2
fi
if ((NODES == 1)); then
  STATE_DIR=${VERL_SLURM_DIR:-/tmp/verl-local-slurm}
  CONF=${VERL_SLURM_CONF:-/etc/slurm/slurm.conf}
else
  # Outside /tmp: the nodes get a private /tmp, and the daemons' state must be the same file for all.
  STATE_DIR=${VERL_SLURM_DIR:-/var/lib/verl-local-slurm}
  CONF=${VERL_SLURM_CONF:-$STATE_DIR/slurm.conf}
fi
# Multi-node hosts: one network namespace each on one bridge; nothing else is addressed.
MULTI_DIR=${VERL_SLURM_DIR:-/var/lib/verl-local-slurm}  # where a multi-node cluster's state is
BRIDGE=verl-slurm0
SUBNET=10.79.0
CTL_HOST=verl-ctl
CTL_ADDR=$SUBNET.2
LOGIN_HOST=verl-login
LOGIN_ADDR=$SUBNET.3
NODE_PREFIX=verl-node
HOSTS_MARK="# verl-local-slurm"  # marks the /etc/hosts lines start.sh adds and stop.sh removes
node_addr() { echo "$SUBNET.$((10 + $1))"; }
