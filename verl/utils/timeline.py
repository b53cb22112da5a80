"""A run's timeline: when each group of ranks generated, trained or synced weights, per step.

``verl train`` (rank 0) appends one line per step to ``<output_dir>/timeline.jsonl``:
``{"step": G, "spans": [[lane, phase, start, end], ...]}`` with wall-clock seconds (``time.time()``). Lanes:
``trainer`` (the training ranks run the trainer's phases in lockstep, so rank 0's timings stand for all of them)
and, with a standalone rollout pool, ``rollout replica k`` (the pool ranks' own segments and weight syncs, as
they report them; across nodes their clocks are as close as NTP keeps them). A step logged twice (a resumed
run) keeps its last line, as ``metrics.jsonl`` does.

``verl plot RUN --timeline --out PNG [--steps A:B]`` draws it: one row per lane, a bar per span, coloured by
phase, so the overlap of generation and training in the asynchronous trainer modes is seen at a glance.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

TIMELINE_FILE = "timeline.jsonl"
TRAINER_LANE = "trainer"

# Phase -> colour; the phases of the trainer (verl's timing_s/* names) and of the pool's segments.
PHASE_COLOURS = {
    "gen": "tab:orange", "generate": "tab:orange", "gen_max": "gold",
    "update_weights": "tab:red",
    "reward": "tab:purple", "old_log_prob": "tab:green", "ref": "yellowgreen", "values": "tab:olive",
    "adv": "tab:pink", "update_critic": "tab:cyan", "update_actor": "tab:blue",
    "testing": "tab:gray", "save_checkpoint": "black",
}
# The trainer's own spans that say nothing about overlap (the whole step encloses every other one).
SKIPPED_PHASES = ("step",)


def pool_lane(replica: int) -> str:
    return f"rollout replica {replica}"


class Timeline:
    """Rank 0's collector: spans are added as phases end and written out once per step (``write``)."""

    def __init__(self, output_dir: str | None):
        self.path = os.path.join(output_dir, TIMELINE_FILE) if output_dir else None
        self.spans: list[list[Any]] = []
        if self.path is not None:
            from verl.utils.tracking import drop_partial_last_line

            os.makedirs(output_dir, exist_ok=True)
            drop_partial_last_line(self.path)

    def add(self, lane: str, phase: str, start: float, end: float) -> None:
        if phase not in SKIPPED_PHASES:
            self.spans.append([lane, phase, round(float(start), 4), round(float(end), 4)])

    def write(self, step: int) -> None:
        """The spans since the last write, as step ``step``'s line."""
        if self.path is not None and self.spans:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"step": int(step), "spans": self.spans}) + "\n")
        self.spans = []


def read_timeline(path: str) -> dict[int, list[tuple[str, str, float, float]]]:
    """``{step: [(lane, phase, start, end), ...]}`` of a run directory's (or the file's) timeline."""
    from verl.utils.tracking import MetricsError, read_metrics

    file = path if os.path.isfile(path) else os.path.join(path, TIMELINE_FILE)
    out: dict[int, list[tuple[str, str, float, float]]] = {}
    for record in read_metrics(file):
        spans = record.get("spans")
        if not isinstance(spans, list) or not all(isinstance(s, list) and len(s) == 4 for s in spans):
            raise MetricsError(f"{file}, step {record['step']}: expected 'spans' as [lane, phase, start, end] lists, "
                               f"found {json.dumps(spans)[:60]}")
        out[record["step"]] = [(str(a), str(b), float(c), float(d)) for a, b, c, d in spans]
    return out


def lane_busy_fractions(spans: Sequence[tuple[str, str, float, float]], phases: Mapping[str, Sequence[str]]
                        ) -> dict[str, float]:
    """Per lane, the fraction of the spans' whole window covered by the named phases (``phases[lane]``),
    overlaps counted once: how busy generation or training kept each lane."""
    if not spans:
        return {}
    begin, end = min(s[2] for s in spans), max(s[3] for s in spans)
    window = max(end - begin, 1e-9)
    out = {}
    for lane, wanted in phases.items():
        intervals = sorted((s[2], s[3]) for s in spans if s[0] == lane and s[1] in wanted)
        covered, reach = 0.0, begin
        for a, b in intervals:
            a = max(a, reach)
            if b > a:
                covered += b - a
                reach = b
        out[lane] = covered / window
    return out


def plot_timeline(timeline: Mapping[int, Sequence[tuple[str, str, float, float]]], out_png: str,
                  steps: tuple[int, int] | None = None, title: str | None = None) -> str:
    """A Gantt chart of the steps ``steps`` (inclusive; default the last six) into ``out_png``; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from verl.utils.tracking import MetricsError

    known = sorted(timeline)
    if not known:
        raise MetricsError("timeline: expected at least one step, found none")
    first, last = steps if steps is not None else (known[max(0, len(known) - 6)], known[-1])
    chosen = [s for s in known if first <= s <= last]
    if not chosen:
        raise MetricsError(f"timeline: expected steps within {first}:{last}, found steps {known[0]}..{known[-1]}")
    spans = [span for s in chosen for span in timeline[s]]
    origin = min(s[2] for s in spans)
    lanes = sorted({s[0] for s in spans}, key=lambda lane: (lane != TRAINER_LANE, lane))
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.8 * len(lanes)))
    fallback = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4)
    colours: dict[str, str] = {}
    # Longest first, so a phase nested in another (update_weights inside gen) is drawn on top of it.
    for lane, phase, start, end in sorted(spans, key=lambda s: -(s[3] - s[2])):
        if phase not in colours:
            colours[phase] = PHASE_COLOURS.get(phase) or next(fallback)
        row = lanes.index(lane)
        ax.broken_barh([(start - origin, max(end - start, 1e-4))], (row - 0.4, 0.8), facecolors=colours[phase],
                       edgecolor="white", linewidth=0.3)
    for step in chosen:  # where each step's trainer work began
        starts = [s[2] for s in timeline[step] if s[0] == TRAINER_LANE]
        if starts:
            x = min(starts) - origin
            ax.axvline(x, color="gray", linewidth=0.6, linestyle=":")
            ax.text(x, len(lanes) - 0.45, f"step {step}", fontsize=7, color="gray", va="bottom")
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_ylim(-0.6, len(lanes) - 0.1)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    handles = [matplotlib.patches.Patch(color=c, label=p) for p, c in colours.items()]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or f"timeline, steps {chosen[0]}-{chosen[-1]}", fontsize=10)
    from verl.utils.figure_file import save_figure

    return save_figure(fig, out_png)
