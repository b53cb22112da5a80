"""How long before a Slurm job's time limit its ranks must be asked to checkpoint, from the run's own figures.

A checkpoint request is honoured at the end of the step in progress, and the checkpoint then takes its own time.
In the worst case the request arrives as a periodic save begins: that save, one more step and the requested save
must all fit. So the lead is ``factor * (step + 2 * save) + margin``, from the longest step and the longest
checkpoint save this run has measured (``timing_s/step`` and ``timing_s/save_checkpoint`` in its
``metrics.jsonl``), the margin covering the file system's noise and the signal's way to every rank. The batch
scripts' deadline timer (``slurm/lib/step.sh``) runs

    python launch/preemption_lead.py --metrics RUN/metrics.jsonl --minimum 0 --margin 60 --factor 1.5

and prints the lead in whole seconds. With nothing measured yet (a first run before its first save) it prints
``--minimum``. Standard library only: it runs every poll of the timer, in a second.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

STEP_KEY = "timing_s/step"
SAVE_KEY = "timing_s/save_checkpoint"


def measured_worst(path: str | None) -> tuple[float, float]:
    """(longest step, longest checkpoint save) in seconds over the metrics file's records; 0 where none.

    A torn last line (the run was killed mid-write) and records without the keys are skipped."""
    step = save = 0.0
    if not path or not os.path.exists(path):
        return step, save
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            step = max(step, _seconds(record.get(STEP_KEY)))
            save = max(save, _seconds(record.get(SAVE_KEY)))
    return step, save


def _seconds(value) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else 0.0


def lead_seconds(path: str | None, minimum: float, margin: float, factor: float) -> int:
    step, save = measured_worst(path)
    if step == 0.0 and save == 0.0:
        return math.ceil(minimum)
    return math.ceil(max(minimum, factor * (step + 2 * save) + margin))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="launch/preemption_lead.py", description=__doc__.split("\n")[0])
    p.add_argument("--metrics", default="", help="the run's metrics.jsonl (missing: nothing measured yet)")
    p.add_argument("--minimum", type=float, default=0.0, help="lead when nothing is measured, and its floor")
    p.add_argument("--margin", type=float, default=60.0, help="seconds added to the scaled measurement")
    p.add_argument("--factor", type=float, default=1.5, help="safety factor on step + 2 saves")
    args = p.parse_args(argv)
    for name in ("minimum", "margin"):
        if getattr(args, name) < 0:
            p.error(f"--{name}: expected >= 0, found {getattr(args, name)}")
    if args.factor < 1:
        p.error(f"--factor: expected >= 1, found {args.factor}")
    print(lead_seconds(args.metrics, args.minimum, args.margin, args.factor))
    return 0


if __name__ == "__main__":
    sys.exit(main())
