"""Waiting for the slowest rollout, bounded by the rollout's own deadline instead of the collective timeout.

Every collective of the job times out after ``actor_rollout_ref.nccl_timeout`` (600 s by default): that is how a
dead or unreachable rank ends the job quickly. But after a generation call the ranks whose rollout finished wait
in the next collective for the one still generating, and a long chain-of-thought rollout may legitimately take
longer than any collective should. So the ranks first meet here, in a barrier of a gloo group whose timeout is
``actor_rollout_ref.rollout.generation_timeout`` (default 3600 s), and only then move the results over the usual
groups. A rollout past that deadline ends the job with one line naming the ranks and rollout replicas that had not
finished (gloo's monitored barrier on rank 0 names them), instead of an opaque collective timeout after 10 minutes.
"""

from __future__ import annotations

import datetime
import os
import re
import time

import torch.distributed as dist

DEFAULT_GENERATION_TIMEOUT_S = 3600.0


class GenerationTimeoutError(RuntimeError):
    """A rollout did not finish within ``actor_rollout_ref.rollout.generation_timeout``."""


class RankLostError(GenerationTimeoutError):
    """The barrier failed long before its deadline: a rank's connection closed (its process or node died).
    The message carries ``lost rank(s) [..]``, which slurm/lib/step.sh reads to name the node that failed."""


class GenerationWait:
    """The barrier the ranks of a job meet at after each generation call. Collective to build (every rank, in
    the same order as the job's other groups). ``rollout_tp``: ranks per rollout replica (names replicas)."""

    def __init__(self, timeout_s: float, rollout_tp: int = 1):
        self.timeout_s = float(timeout_s)
        self.rollout_tp = max(1, int(rollout_tp))
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s)) \
            if self.world > 1 else None

    def wait(self, what: str) -> None:
        """Every rank has finished ``what`` (a generation call) or :class:`GenerationTimeoutError` is raised."""
        delay = injected_delay(dist.get_rank() if dist.is_initialized() else 0)
        if delay:
            time.sleep(delay)
        if self.group is None:
            return
        t0 = time.monotonic()
        try:
            dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=self.timeout_s),
                                   wait_all_ranks=True)
        except RuntimeError as err:
            # Rank 0 watches the barrier and learns who never arrived; the others only that rank 0 gave up.
            ranks = sorted({int(r) for part in re.findall(r"Ranks? ([\d, ]+) failed", str(err))
                            for r in part.replace(",", " ").split()})
            limit = (f"actor_rollout_ref.rollout.generation_timeout={self.timeout_s:g} s; raise it for longer "
                     "rollouts (actor_rollout_ref.nccl_timeout bounds every other wait)")
            waited = time.monotonic() - t0
            # gloo words a peer's closed connection as a failed barrier too ("failed to pass monitoredBarrier in
            # <timeout> ms"); only the time waited tells a dead rank from a slow one.
            if ranks and waited < 0.9 * self.timeout_s:
                replicas = sorted({r // self.rollout_tp for r in ranks})
                raise RankLostError(f"{what}: lost rank(s) {ranks} (rollout replica(s) {replicas}): their "
                                    f"connection closed after {waited:.1f} s, before the {self.timeout_s:g} s "
                                    "generation deadline (the process or its node died)") from None
            if ranks:
                replicas = sorted({r // self.rollout_tp for r in ranks})
                raise GenerationTimeoutError(f"{what}: rank(s) {ranks} (rollout replica(s) {replicas}) had not "
                                             f"finished after {limit}") from None
            raise GenerationTimeoutError(f"{what}: the rollouts had not all finished after {limit} (rank 0's "
                                         "error names the ranks still generating)") from None


def injected_delay(rank: int, variable: str = "VERL_TEST_SLOW_GENERATION") -> float:
    """Fault injection for the tests (``VERL_TEST_SLOW_GENERATION=RANK:SECONDS``): rank RANK's rollout takes
    that much longer. A standalone pool's ranks read ``VERL_TEST_SLOW_POOL_GENERATION`` (RANK: the pool rank)."""
    spec = os.environ.get(variable, "")
    slow, _, seconds = spec.partition(":")
    return float(seconds) if slow.strip() and int(slow) == rank else 0.0
