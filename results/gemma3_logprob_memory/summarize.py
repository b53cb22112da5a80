"""Summarize results/gemma3_logprob_memory/logs/memory.json (launch/bench_logprob_memory.py's record).

    python results/gemma3_logprob_memory/summarize.py results/gemma3_logprob_memory/logs              # summary lines
    python results/gemma3_logprob_memory/summarize.py results/gemma3_logprob_memory/logs --markdown   # README's table

``--markdown`` prints the table of this directory's README.md after its marker line (``<!-- results/... -->``);
tests/unit/test_results_tables.py checks that the README's table is this, digit for digit."""

import json
import sys
from pathlib import Path


def records(logs: Path) -> list[dict]:
    return json.loads((logs / "memory.json").read_text())["records"]


def _label(r: dict) -> str:
    return r["model"] + ("" if r.get("chunk_tokens") is None else f", fixed chunks of {r['chunk_tokens']} tokens")


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def lines(logs: Path) -> list[str]:
    out = []
    for r in records(logs):
        out.append(f"{_label(r)}: vocab {r['vocab_size']}, {r['parameters'] / 1e6:.0f}M parameters; log_prob peak "
                   f"{r['log_prob_peak_gib']:.2f} GiB ({r['log_prob_peak_ratio']:.2f}x), "
                   f"+{r['log_prob_increment_gib']:.2f} GiB ({_ratio(r['log_prob_increment_ratio'])}); "
                   f"update peak {r['update_peak_gib']:.2f} GiB "
                   f"({r['update_peak_ratio']:.2f}x), +{r['update_increment_gib']:.2f} GiB "
                   f"({_ratio(r['update_increment_ratio'])})")
    return out


def markdown(logs: Path) -> list[str]:
    out = ["<!-- results/gemma3_logprob_memory:peaks -->",
           "| model | vocab | parameters | resident before | log-prob + entropy peak (ratio) | its increment (ratio) "
           "| update peak (ratio) | its increment (ratio) |", "|---|---|---|---|---|---|---|---|"]
    for r in records(logs):
        out.append(f"| {_label(r)} | {r['vocab_size']} | {r['parameters'] / 1e6:.0f}M | "
                   f"{r['log_prob_resident_gib']:.2f} GiB | {r['log_prob_peak_gib']:.2f} GiB "
                   f"({r['log_prob_peak_ratio']:.2f}x) | {r['log_prob_increment_gib']:.2f} GiB "
                   f"({_ratio(r['log_prob_increment_ratio'])}) | {r['update_peak_gib']:.2f} GiB "
                   f"({r['update_peak_ratio']:.2f}x) | {r['update_increment_gib']:.2f} GiB "
                   f"({_ratio(r['update_increment_ratio'])}) |")
    return out


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1])) if "--markdown" in sys.argv[2:] else lines(Path(sys.argv[1]))))
