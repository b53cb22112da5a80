"""Summarize results/startup/logs: rank 0's `startup:` line of each run, per mode (forked ranks, fresh ones).

    python results/startup/summarize.py results/startup/logs              # the summary
    python results/startup/summarize.py results/startup/logs --markdown   # the README table, rebuilt"""

import re
import statistics
import sys
from pathlib import Path

LINE = re.compile(r"startup: the first step ended ([\d.]+)s after the launch \((.*), the step ([\d.]+)s\)")
CPU = re.compile(r"^cpu_s user ([\d.]+) sys ([\d.]+) wall ([\d.]+)$", re.M)
MODES = {"fork": "forked from the fork server (default)", "exec": "fresh interpreters (VERL_RANK_START=exec)"}


def runs(logs: Path) -> dict[str, list[dict[str, float]]]:
    """mode -> one {phase: seconds, "total": seconds} per run."""
    out: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for path in sorted(logs.glob("*.log")):
        mode = path.name.split(".")[0]
        text = path.read_text()
        match, cpu = LINE.search(text), CPU.search(text)
        if mode not in out or match is None or cpu is None:
            raise SystemExit(f"{path}: expected rank 0's startup line and the run's cpu_s line, found neither")
        phases = {name: float(seconds.rstrip("s")) for name, seconds in
                  (part.rsplit(" ", 1) for part in match.group(2).split(", "))}
        out[mode].append({"total": float(match.group(1)), **phases, "the step": float(match.group(3)),
                          "CPU seconds of the whole run (every process)": float(cpu.group(1)) + float(cpu.group(2))})
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def markdown(logs: Path) -> list[str]:
    data = runs(logs)
    phases = list(data["fork"][0])
    out = ["<!-- results/startup:first_step -->",
           "| seconds, median (min-max) of " + str(len(data["fork"])) + " runs | "
           + " | ".join(MODES[m] for m in MODES) + " |",
           "|---|" + "---|" * len(MODES)]
    for phase in phases:
        name = "launch to the end of step 1" if phase == "total" else phase
        out.append(f"| {name} | " + " | ".join(spread([r[phase] for r in data[m]]) for m in MODES) + " |")
    ratio = statistics.median(r["total"] for r in data["exec"]) / statistics.median(r["total"] for r in data["fork"])
    out.append(f"| launch to the end of step 1, relative to forked (medians) | 1.00x | {ratio:.2f}x |")
    return out


if __name__ == "__main__":
    logs = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "logs")
    print("\n".join(markdown(logs)))
