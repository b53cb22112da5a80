"""`verl train --config F [key=value ...] [--dry-run]`: PPO-family RL training.

verl's own command lines work too, with Hydra's override grammar (``k=v``, ``+k=v``, ``~k``, lists)::

    python3 -m verl.trainer.main_ppo model_engine=megatron k=v ... "$@"                  # verl 0.9
    python3 -m verl.trainer.main_ppo --config-path=config --config-name=ppo_megatron_trainer.yaml k=v ... [--cfg job]

``--config-path`` is relative to this file (``config`` = the packaged defaults, ``verl/trainer/config``) or
absolute; ``--config F`` merges F over the defaults; ``--cfg job`` prints the resolved config and exits.
Without ``--config-name`` the config is verl 0.9's choice: ``model_engine=megatron`` -> ppo_megatron_trainer,
``model_engine=dp`` (verl's FSDP engine) or neither -> ppo_trainer; a ``--config F`` file without
``model_engine`` keeps the ppo_megatron_trainer defaults it is written against. ``ray_kwargs.*`` is ignored
with one warning (there is no Ray here).

The config is loaded and validated first; a bad one prints one line and exits 2 before any rank
starts. Then:
- under Slurm / torchrun / mpirun (the launcher set the rank variables) this process is one rank;
- otherwise, for ``trainer.nnodes * trainer.n_gpus_per_node`` = 1 everything runs in this process;
- otherwise this process spawns that many local ranks (``verl.launcher.spawn.spawn_local``) running
  ``python -m verl.trainer.main_ppo`` with the same arguments, and returns their exit code.

``VERL_DEVICE_MAP=multi``: where the file and overrides name no parallel layout, one is chosen from the model's
size, the ranks and the memory per device and printed in one ``[layout]`` block (:mod:`verl.trainer.config.
auto_layout`).

``--dry-run`` runs one step (generation, rewards, log-probs, values, advantages, metrics) without
updating weights, saving checkpoints or validating.

Errors: bad input (config, data, model or checkpoint) is found before any rank starts
(``verl.trainer.preflight``) and printed as one line, exit 2. A rank that fails later writes its
traceback to ``<trainer.output_dir>/logs/train.rank<r>.traceback`` and the job ends with one line on
stderr naming the first failing rank (``verl train: rank 1: DatasetError: ...``): exit 2 for input
errors (:class:`verl.errors.InputError`), 1 for anything else (an internal error).
"""

from __future__ import annotations

import argparse
import sys

from verl.errors import EXIT_INPUT_ERROR, InputError, OneLineArgumentParser, exit_code, refuse
from verl.launcher.env import launcher_rank

RANK_ERROR_DIR_ENV = "VERL_RANK_ERROR_DIR"  # set by the local launcher: ranks leave their one line there


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="verl train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="a trainer YAML merged over the defaults (e.g. configs/grpo_arith_tiny.yaml)")
    parser.add_argument("--config-path", "-cp", dest="config_path", metavar="DIR",
                        help="Hydra's config directory: absolute, or relative to verl/trainer/ (verl's `config`)")
    parser.add_argument("--config-name", "-cn", dest="config_name", metavar="NAME",
                        help="Hydra's config name in --config-path (default: as verl 0.9, ppo_megatron_trainer for "
                             "model_engine=megatron, else ppo_trainer; ppo_megatron_trainer under --config)")
    parser.add_argument("--cfg", choices=("job",), help="print the resolved config (Hydra's --cfg job) and exit")
    parser.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                        help="one step without weight updates")
    parser.add_argument("--log_dir", "--log-dir", dest="log_dir", metavar="DIR",
                        help="also write the console output to DIR/train.log (verl's guides use this flag)")
    parser.add_argument("--tensorboard_dir", "--tensorboard-dir", dest="tensorboard_dir", metavar="DIR",
                        help="TensorBoard event files go here (verl's TENSORBOARD_DIR), not <output_dir>/tensorboard")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. trainer.total_training_steps=3 algorithm.adv_estimator=grpo")
    return parser


def _rank_failure(err: BaseException, config) -> int:
    """One line for the user, the traceback for the log; the exit code says input (2) or internal (1)."""
    import os
    import traceback

    rank = launcher_rank()
    message = (str(err).strip().splitlines() or [""])[0]
    line = f"rank {rank}: {type(err).__name__}: {message}"
    log_dir = os.path.join(os.path.abspath(config.trainer.output_dir), "logs")
    trace = os.path.join(log_dir, f"train.rank{rank}.traceback")
    try:
        os.makedirs(log_dir, exist_ok=True)
        with open(trace, "w", encoding="utf-8") as fh:
            fh.write("".join(traceback.format_exception(err)))
        line += f" (traceback: {trace})"
    except OSError:
        pass
    error_dir = os.environ.get(RANK_ERROR_DIR_ENV)
    if error_dir:  # the local launcher prints the first rank's line
        with open(os.path.join(error_dir, f"rank{rank}.err"), "w", encoding="utf-8") as fh:
            fh.write(line + "\n")
    else:
        print(f"verl train: {line}", file=sys.stderr, flush=True)
    return exit_code(err)


def _first_rank_error(error_dir: str) -> str | None:
    import os

    files = [os.path.join(error_dir, f) for f in os.listdir(error_dir) if f.endswith(".err")]
    if not files:
        return None
    with open(min(files, key=os.path.getmtime), encoding="utf-8") as fh:
        return fh.readline().strip()


def run_rank(config, dry_run: bool) -> int:
    """This process as one rank of the job: torch.distributed, workers, the PPO loop."""
    try:
        return _run_rank(config, dry_run)
    except Exception as err:  # noqa: BLE001 - one line per failing rank, traceback to the run's log
        return _rank_failure(err, config)


def _close_after_error(trainer) -> None:
    """Close after ``fit`` raised: the run's own error is the one to report, so a close that fails too (a pool
    link the error broke, for one) is one warning line instead of replacing it."""
    try:
        trainer.close()
    except Exception as err:  # noqa: BLE001 - reported, then the original error propagates
        print(f"closing the trainer after the error below failed too: {type(err).__name__}: {err}", file=sys.stderr)


def _run_rank(config, dry_run: bool) -> int:
    from verl.launcher import startup
    from verl.launcher.bootstrap import destroy_distributed, init_distributed
    from verl.launcher.pools import POOL_ROLLOUT, split_from_config

    startup.mark("config")

    split = split_from_config(config)  # None: the rollout is colocated on the training ranks
    # verl's key for the process groups' timeout: a collective stuck on a lost peer raises after it.
    env = init_distributed(seed=config.trainer.seed, timeout_s=float(config.actor_rollout_ref.nccl_timeout),
                           pools=split)
    startup.mark("process groups")
    try:
        from transformers import AutoTokenizer

        from verl.trainer.v1 import trainer_class

        tokenizer = AutoTokenizer.from_pretrained(config.data.tokenizer)
        if split is not None and split.pool_of(env.rank)[0] == POOL_ROLLOUT:
            from verl.workers.rollout_pool import serve_rollout_pool

            return serve_rollout_pool(config, tokenizer)
        trainer = trainer_class(config)(config, tokenizer, dry_run=dry_run)
        startup.mark("workers")
        try:
            code = trainer.fit()
        except BaseException:
            _close_after_error(trainer)
            raise
        else:
            trainer.close()
        finally:
            del trainer  # the engines go before the process group (see destroy_distributed)
        # Leave together: a rank that tears its process group down and exits while rank 0 is still
        # writing (the HF export, the last checkpoint) was seen to abort in teardown.
        import torch.distributed as dist

        dist.barrier()
        return code
    finally:
        destroy_distributed()


class _Tee:
    """Writes to the console stream and to a log file (``--log_dir``)."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        self.log.flush()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()
        self.log.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _open_log_dir(log_dir: str):
    """``DIR/train.log`` (rank 0 or the local launcher); the other ranks of a launched job write
    ``DIR/train.rank<r>.log`` so their lines do not interleave."""
    import os

    rank = launcher_rank()
    try:
        os.makedirs(log_dir, exist_ok=True)
        return open(os.path.join(log_dir, "train.log" if rank == 0 else f"train.rank{rank}.log"), "a",
                    encoding="utf-8")
    except OSError as err:
        print(f"verl train: --log_dir: expected a writable directory, found {log_dir} ({err.strerror})",
              file=sys.stderr)
        raise SystemExit(EXIT_INPUT_ERROR) from None


def actor_memory_estimate(config) -> str:
    """The actor's estimated memory per rank for the config's layout (``verl.models.memory``), one line."""
    from verl.trainer.config.derived import actor_dp_size, backend_rules

    return backend_rules(config).memory_estimate(config, actor_dp_size(config))


def main(argv: list[str] | None = None) -> int:
    from verl.launcher import startup
    from verl.launcher.preemption import hold_early_preemption

    startup.mark_process_start("launcher")  # a spawned rank: what its launcher did before starting it

    hold_early_preemption()  # Slurm's preemption signal during start-up: honoured after the first step, not fatal
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_intermixed_args(argv)  # flags and key=value overrides in any order
    except InputError as err:
        return refuse("verl train", err)
    if args.tensorboard_dir:
        import os

        os.environ["TENSORBOARD_DIR"] = os.path.abspath(args.tensorboard_dir)
    if args.log_dir:
        log = _open_log_dir(args.log_dir)
        sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)

    from verl.launcher.env import LaunchError, discover
    from verl.trainer.config import ConfigError, auto_layout, load_config
    from verl.trainer.config.loader import config_dir_from_cli

    try:
        env = discover()
    except LaunchError as err:
        print(f"verl train: {err}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    launched = env.source != "local"
    overrides, chosen = list(args.overrides), []
    config_dir = config_dir_from_cli(args.config_path, __file__)
    try:
        if auto_layout.requested():  # VERL_DEVICE_MAP=multi: a layout chosen where the user names none
            chosen, block = auto_layout.chosen_overrides(args.config, overrides, env.world_size if launched else None,
                                                         config_dir, args.config_name)
            overrides += chosen
            if launcher_rank() == 0:  # --cfg job prints YAML on stdout: the block goes beside it
                print(block, file=sys.stderr if args.cfg == "job" else sys.stdout, flush=True)
        config = load_config(args.config, overrides, launcher_world_size=env.world_size if launched else None,
                             config_dir=config_dir, config_name=args.config_name, resolve_only=args.cfg == "job")
    except ConfigError as err:
        print(f"verl train: config error: {err}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    except InputError as err:  # the model a layout is chosen for does not load, or the memory given is no size
        print(f"verl train: {err}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    if args.cfg == "job":
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(config), end="")
        return 0
    return _check_and_run(config, argv, args, launched, chosen)


def _choose_recompute(config) -> list[str]:
    """Activation recompute where the user did not choose it, decided here once (verl.trainer.config.
    recompute_choice): set in ``config`` and returned as the override that hands it to spawned ranks."""
    from omegaconf import OmegaConf

    from verl.trainer.config import recompute_choice

    choice, line = recompute_choice.choose(config)
    if choice is None:
        return []
    OmegaConf.update(config, recompute_choice.KEY, choice, merge=False)
    if launcher_rank() == 0:
        print(line, flush=True)
    return [f"{recompute_choice.KEY}={str(choice).lower()}"]


def _rank_modules(config) -> tuple[list[str], tuple[str, ...]]:
    """What a rank of this config imports before its first step, for the fork server to import once: (the
    modules, the modules each backend may or may not have)."""
    from verl.engine.strategies import ENGINE_TABLE, STRATEGIES
    from verl.trainer.v1 import trainer_module

    modules = ["transformers", "verl.trainer.preflight", trainer_module(config),
               "verl.workers.actor_rollout_ref_worker", "verl.hybrid_engine.hybrid_engine",
               "verl.workers.reward_manager.naive"]
    optional = [f"verl.engine.rollout.{config.actor_rollout_ref.rollout.name}.engine"]
    entry = ENGINE_TABLE.get(STRATEGIES.get(config.actor_rollout_ref.actor.strategy, ""))
    if entry is not None and isinstance(entry.engine_class, str):
        module = entry.engine_class.partition(":")[0]
        modules.append(module)
        optional.append(f"{module.rpartition('.')[0]}.actor")
    return modules, tuple(optional)


def _check_and_run(config, argv: list[str], args, launched: bool, chosen: list[str]) -> int:
    """The config's preflight, then this process as the one rank, a launched rank, or the local launcher."""
    from omegaconf import OmegaConf

    from verl.errors import InputError
    from verl.trainer.config import job_size
    from verl.trainer.config.sections import PPOSections
    from verl.trainer.preflight import preflight

    try:
        preflight(PPOSections.from_tree(config, ""))
    except InputError as err:  # PreflightError, DatasetError, CheckpointError, ModelConfigError, ...
        print(f"verl train: {err}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    chosen = chosen + _choose_recompute(config)
    if args.dry_run:
        print(actor_memory_estimate(config), flush=True)
    world = job_size(config)  # the training ranks, then a standalone rollout pool's (rollout.nnodes > 0)
    if launched or world == 1:
        return run_rank(config, args.dry_run)
    for key in ("trainer", "actor_rollout_ref.rollout"):
        nnodes = OmegaConf.select(config, f"{key}.nnodes")
        if nnodes > 1:
            print(f"verl train: config error: {key}.nnodes={nnodes}: expected 1 outside a launcher (multi-node runs "
                  f"start under srun/mpirun, see slurm/)", file=sys.stderr)
            return EXIT_INPUT_ERROR
    from verl.launcher.forkserver import ForkServer

    # The ranks fork from one process that imported what they need (verl.launcher.forkserver), where that is safe.
    server = ForkServer.start(*_rank_modules(config))
    try:
        return _spawn_ranks(argv, chosen, world, server)
    finally:
        if server is not None:
            server.close()


def _spawn_ranks(argv: list[str], chosen: list[str], world: int, server) -> int:
    """``world`` local ranks of this command (forked from ``server`` when it has one); their exit code."""
    import os
    import signal
    import tempfile

    from verl.launcher import startup
    from verl.launcher.spawn import spawn_local, without_option
    from verl.trainer.config import auto_layout

    with tempfile.TemporaryDirectory(prefix="verl_rank_errors_") as error_dir:
        # The ranks' output reaches this process's console (and its --log_dir copy): they write no log of their own.
        # The chosen layout travels as overrides: the ranks neither choose again nor print the block again.
        rank_argv = [*without_option(argv, "--log_dir", "--log-dir"), *chosen]
        rank_env = {key: value for key, value in os.environ.items() if key != auto_layout.DEVICE_MAP_ENV}
        rank_env.update(startup.rank_environment())  # the ranks' start-up clock starts at this launcher's
        failure: dict = {}
        code = spawn_local(world, [sys.executable, "-m", "verl.trainer.main_ppo", *rank_argv],
                           env={**rank_env, RANK_ERROR_DIR_ENV: error_dir}, failure=failure, forkserver=server)
        line = None
        if failure.get("signal"):  # killed by a signal: it left no line of its own
            line = f"rank {failure['rank']}: killed by {signal.Signals(failure['signal']).name} (exit {code})"
        elif code != 0:
            line = _first_rank_error(error_dir)
    if line:
        print(f"verl train: {line}", file=sys.stderr)
    return code


if __name__ == "__main__":
    from verl.launcher.bootstrap import exit_process

    exit_process(main())  # a rank (or the local launcher): everything it opened is closed by now
