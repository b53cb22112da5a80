"""Summarize results/gemma3_add_sub/logs: Gemma 3 270M (the base model) learning one-step addition and subtraction
word problems with GRPO, one run per seed.

    python results/gemma3_add_sub/summarize.py results/gemma3_add_sub/logs              # per run
    python results/gemma3_add_sub/summarize.py results/gemma3_add_sub/logs --markdown   # README tables

The per-run figures are those of results/gemma3_word_problems/summarize.py (the same job on another task), plus the
wall time of the whole GRPO stage from each run's ``summary.json`` (start-up and every validation included: what the
issue's 25-minute budget counts) and the held-out curve, seed by seed."""

import importlib.util
import json
import statistics
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "gemma3_word_problems_summary", Path(__file__).resolve().parents[1] / "gemma3_word_problems" / "summarize.py")
word_problems = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(word_problems)


def wall_minutes(run: Path) -> float:
    return json.loads((run / "summary.json").read_text())["wall_s"]["grpo"] / 60.0


def curve(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]


def lines(logs: Path) -> list[str]:
    walls = {seed: wall_minutes(logs / f"seed{seed}") for seed in word_problems.runs(logs)}
    return [f"{line}; GRPO stage {walls[seed]:.1f} min wall" for seed, line in zip(walls, word_problems.lines(logs),
                                                                                  strict=True)]


def markdown(logs: Path) -> list[str]:
    found = word_problems.runs(logs)
    walls = [wall_minutes(logs / f"seed{seed}") for seed in found]
    table = word_problems.markdown(logs)
    table[0] = "<!-- results/gemma3_add_sub:runs -->"
    table[1] += " GRPO stage, wall minutes |"
    table[2] += "---|"
    table[3] += f" {word_problems.spread(walls, '.1f')} |"
    curves = {seed: dict(curve(logs / f"seed{seed}")) for seed in found}
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    mean = [statistics.mean(c[s] for c in curves.values()) for s in steps]
    return [*table, "", "<!-- results/gemma3_add_sub:curve -->",
            "| step | " + " | ".join(f"seed {seed}" for seed in curves) + " | mean |",
            "|---|" + "---|" * (len(curves) + 1),
            *(f"| {s} | " + " | ".join(f"{c[s]:.3f}" for c in curves.values()) + f" | {m:.3f} |"
              for s, m in zip(steps, mean, strict=True))]


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1])) if "--markdown" in sys.argv[2:] else lines(Path(sys.argv[1]))))
