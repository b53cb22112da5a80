#!/usr/bin/env bash
# Run CMD on the login host of the multi-node cluster (VERL_SLURM_NODES=N slurm/local/start.sh), in the
# current directory with the current environment plus SLURM_CONF:
#
#   slurm/local/login.sh sinfo
#   slurm/local/login.sh sbatch -N 2 slurm/multinode_cpu.sbatch
#   slurm/local/login.sh bash            # a shell on the login host
#
# The login host (verl-login, 10.79.0.3) is a network namespace on the cluster's bridge with its own
# host name: srun listens for its tasks on the address that name resolves to, which the nodes reach.
# From this machine's own shell srun would bind loopback (unreachable from the nodes) or every interface.
# Exit code: CMD's; 2 when no multi-node cluster is running.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=SCRIPTDIR/cluster.sh
source "$HERE/cluster.sh"
if (($# == 0)); then
  echo "usage: slurm/local/login.sh CMD [ARG ...]" >&2
  exit 2
fi
if [[ ! -s $MULTI_DIR/cluster.env || ! -e /run/netns/$LOGIN_HOST ]]; then
  echo "slurm/local/login.sh: expected a multi-node cluster (VERL_SLURM_NODES=2 bash slurm/local/start.sh)," \
    "found none in $MULTI_DIR" >&2
  exit 2
fi
SLURM_CONF=$(sed -n 's/^SLURM_CONF=//p' "$MULTI_DIR/cluster.env")
export SLURM_CONF
# shellcheck disable=SC2016  # $1, $@: the inner shell's arguments
exec nsenter --net="/run/netns/$LOGIN_HOST" unshare --uts \
  bash -c 'hostname "$1" && shift && exec "$@"' login "$LOGIN_HOST" "$@"
