"""``python -m launch.slurm_check [-- verl train ARGS]``: what a multi-node batch script checks before any rank
starts. One line and exit 2 when

- the allocation cannot run one trainer rank per task with the same count on every node (the node list, the
  task layout and SLURM_NTASKS disagree, or the tasks are uneven: ``sbatch -N 2 -n 3``);
- the rendezvous host (MASTER_ADDR, else the job's first node) does not resolve;
- given the trainer's arguments (after ``--``): the config cannot run at this world size (``-N`` larger than
  its layout allows: the batch does not split over that many ranks, TP*PP does not divide it, ...) or any
  other input ``verl train`` would refuse before its ranks start (data, tokenizer, model, checkpoint).

On success it prints one line: nodes, tasks per node and the rendezvous address.
"""

from __future__ import annotations

import sys

from verl.errors import EXIT_INPUT_ERROR


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_argv = argv[argv.index("--") + 1:] if "--" in argv else None
    if train_argv is None and argv:
        print(f"launch.slurm_check: expected no arguments or '-- verl train ARGS', found {' '.join(argv)}",
              file=sys.stderr)
        return EXIT_INPUT_ERROR
    from verl.errors import InputError
    from verl.launcher.bootstrap import resolve_ipv4
    from verl.launcher.env import check_allocation

    try:
        alloc = check_allocation()
        addr = resolve_ipv4(alloc.master_addr, "the rendezvous host (MASTER_ADDR, else the job's first node)")
        if train_argv is not None:
            _check_trainer(train_argv, len(alloc.nodes) * alloc.tasks_per_node)
    except InputError as err:
        print(f"launch.slurm_check: {err}", file=sys.stderr, flush=True)
        return EXIT_INPUT_ERROR
    print(f"launch.slurm_check: {len(alloc.nodes)} nodes x {alloc.tasks_per_node} tasks; "
          f"rendezvous {alloc.master_addr} ({addr})", flush=True)
    return 0


def _check_trainer(train_argv: list[str], world: int) -> None:
    """``verl train``'s own checks (config at this world size, then its pre-flight) without starting a rank."""
    from verl.trainer.config import load_config
    from verl.trainer.config.loader import config_dir_from_cli
    from verl.trainer.config.sections import PPOSections
    from verl.trainer.main_ppo import build_parser
    from verl.trainer.preflight import preflight

    if train_argv[:1] == ["train"]:
        train_argv = train_argv[1:]
    args = build_parser().parse_intermixed_args(train_argv)
    import verl.trainer.main_ppo as main_ppo

    config = load_config(args.config, args.overrides, launcher_world_size=world,
                         config_dir=config_dir_from_cli(args.config_path, main_ppo.__file__),
                         config_name=args.config_name)
    preflight(PPOSections.from_tree(config, ""))


if __name__ == "__main__":
    sys.exit(main())
