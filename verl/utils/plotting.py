"""`verl plot METRICS.jsonl --out PNG`: one PNG of a training run's curves, per step.

Four panels from the metrics ``verl train`` logs (``verl/trainer/metrics.py`` names):
  reward           critic/score/mean (the task score) and critic/rewards/mean (after a KL penalty)
  accuracy         val/accuracy, the greedy validation logged at step 0 and every test_freq steps
  KL               actor/ppo_kl (rollout policy vs updated actor), actor/kl_loss (to the reference,
                   GRPO's KL loss) and actor/reward_kl_penalty (PPO's KL in the reward), when logged
  response length  response_length/mean, with its min-max band

With ``--timeline``: the run's ``timeline.jsonl`` instead, one row per lane (the trainer, each rollout replica of a
standalone pool), a bar per phase (``verl/utils/timeline.py``), for ``--steps A:B`` (default the last six).

A panel whose metrics are absent says so instead of drawing nothing. matplotlib runs on its Agg
backend (no display needed); the file is written then renamed, so a reader never sees half a PNG.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from verl.errors import EXIT_INPUT_ERROR
from verl.utils.figure_file import save_figure

# (panel title, [(metric, legend label)], y label)
PANELS: tuple[tuple[str, tuple[tuple[str, str], ...], str], ...] = (
    ("reward", (("critic/score/mean", "score (task)"), ("critic/rewards/mean", "reward (after KL)")),
     "mean per response"),
    ("validation accuracy (greedy)", (("val/accuracy", "val/accuracy"),), "exact match"),
    ("KL", (("actor/ppo_kl", "ppo_kl (old vs new)"), ("actor/kl_loss", "kl_loss (vs ref)"),
            ("actor/reward_kl_penalty", "reward_kl_penalty (vs ref)")), "nats / token"),
    ("response length", (("response_length/mean", "mean"),), "tokens"),
)


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(int(record["step"]))
            values.append(float(value))
    return steps, values


def plot_metrics(records: Sequence[dict[str, Any]], out_png: str, title: str | None = None) -> str:
    """Draw the four panels of ``records`` (``read_metrics`` rows) into ``out_png``; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for ax, (panel, metrics, ylabel) in zip(axes.flat, PANELS, strict=False):
        drawn = False
        for key, label in metrics:
            steps, values = _series(records, key)
            if not steps:
                continue
            # Validation is sparse (a few steps): markers make single points visible.
            ax.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=4, label=label)
            drawn = True
        if panel == "response length":
            low, high = _series(records, "response_length/min"), _series(records, "response_length/max")
            if low[0] and low[0] == high[0]:
                ax.fill_between(low[0], low[1], high[1], alpha=0.2, label="min-max")
        if drawn:
            ax.legend(fontsize=8, loc="best")
        else:
            names = ", ".join(key for key, _ in metrics)
            ax.text(0.5, 0.5, f"not logged:\n{names}", ha="center", va="center", fontsize=8,
                    transform=ax.transAxes, color="gray")
        ax.set_title(panel, fontsize=10)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    last = max((int(r["step"]) for r in records), default=0)
    fig.suptitle(title or f"training metrics ({last} steps)", fontsize=11)
    return save_figure(fig, out_png)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl plot", description=__doc__.splitlines()[0])
    parser.add_argument("metrics", metavar="METRICS.jsonl",
                        help="a run's metrics.jsonl (or its directory, trainer.output_dir)")
    parser.add_argument("--out", required=True, metavar="PNG", help="where to write the plot")
    parser.add_argument("--title", default=None, help="figure title (default: the step count)")
    parser.add_argument("--timeline", action="store_true",
                        help="draw the run's timeline.jsonl (generation / training / weight sync per lane) instead")
    parser.add_argument("--steps", default=None, metavar="A:B", help="with --timeline: the steps drawn (inclusive)")
    return parser


def _steps(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    first, sep, last = text.partition(":")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit() or int(first) > int(last):
        raise ValueError(f"--steps: expected A:B with integers A <= B, found {text!r}")
    return int(first), int(last)


def _timeline_main(args: argparse.Namespace) -> int:
    from verl.utils.timeline import TIMELINE_FILE, plot_timeline, read_timeline
    from verl.utils.tracking import MetricsError

    path = args.metrics
    if os.path.basename(path) == "metrics.jsonl":
        path = os.path.dirname(path) or "."
    if not (os.path.isfile(path) or os.path.isfile(os.path.join(path, TIMELINE_FILE))):
        print(f"verl plot: expected a {TIMELINE_FILE} or a run directory holding one, found nothing at {path}",
              file=sys.stderr)
        return EXIT_INPUT_ERROR
    try:
        steps = _steps(args.steps)
        out = plot_timeline(read_timeline(path), args.out, steps, args.title)
    except (MetricsError, ValueError) as exc:  # ValueError: only _steps' (a bad --steps)
        print(f"verl plot: {exc}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    print(f"timeline -> {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from verl.utils.tracking import MetricsError, read_metrics

    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.timeline:
        return _timeline_main(args)
    path = args.metrics
    if not (os.path.isfile(path) or os.path.isfile(os.path.join(path, "metrics.jsonl"))):
        print(f"verl plot: expected a metrics.jsonl file or a directory holding one, found nothing at {path}",
              file=sys.stderr)
        return EXIT_INPUT_ERROR
    try:
        records = read_metrics(path)
    except MetricsError as exc:
        print(f"verl plot: {exc}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    if not records:
        print(f"verl plot: expected at least one record in {path}, found an empty file", file=sys.stderr)
        return EXIT_INPUT_ERROR
    out = plot_metrics(records, args.out, args.title)
    print(f"plot: {len(records)} steps -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
