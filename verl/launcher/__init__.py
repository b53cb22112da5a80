"""Rank discovery, rendezvous and process start-up (no Ray): what every verl entry point uses.

- `verl.launcher.env`: who am I? (`discover()` -> `DistEnv` from Slurm, Open MPI, torchrun or local)
- `verl.launcher.bootstrap`: `init_distributed()` — rendezvous (mpi4py or env), torch.distributed, device, seed
- `verl.launcher.threads`: the one thread policy (`intra_op_threads`: a rank's share of this host's cores)
- `verl.launcher.spawn`: local ranks, the one spawner (`LocalRanks`: N rank processes, torchrun's variables,
  fail-fast, a deadline, signal forwarding, death with the parent): `spawn_local()` runs a command as N
  ranks; `run_ranks()` runs a function on N gloo ranks (`verl.launcher.function_rank`) and returns its values
- `verl.launcher.preemption`: `PreemptionHandler` — SIGUSR1/SIGTERM -> every rank stops at the same step
"""

from verl.launcher.env import DistEnv, LaunchError, discover, expand_nodelist

__all__ = ["DistEnv", "LaunchError", "discover", "expand_nodelist"]
