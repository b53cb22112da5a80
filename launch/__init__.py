"""Launch: rank discovery, rendezvous and process start-up for verl-hpc.

- `launch.env`: who am I? (`discover()` -> `DistEnv` from Slurm, Open MPI, torchrun or local)
- `launch.bootstrap`: `init_distributed()` — rendezvous (mpi4py or env), torch.distributed, device, seed
- `launch.spawn`: `spawn_local()` — N local ranks as subprocesses, fail-fast, signal forwarding
- `launch.preemption`: `PreemptionHandler` — SIGUSR1/SIGTERM -> every rank stops at the same step
- `python -m launch.selftest`: a tiny real distributed job used by the tests and the sbatch templates
"""

from launch.env import DistEnv, LaunchError, discover, expand_nodelist

__all__ = ["DistEnv", "LaunchError", "discover", "expand_nodelist"]
