"""Summarize results/sentiment/logs: per reward (the BERT RM, the Qwen2 judge) and seed, the reward model's own score
on the training prompts (critic/score/mean, steps 1 and 40) beside the rule's verdict on the held-out films (the
validation dumps, 4 samples a prompt, before step 1 and after step 40). The rule is the task's definition of
sentiment, positive minus negative words, applied here to the dumped text itself.

    python results/sentiment/summarize.py results/sentiment/logs              # the summary
    python results/sentiment/summarize.py results/sentiment/logs --markdown   # the README table, rebuilt"""

import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the task's rule itself, not a copy (a small module: no torch import)
from verl.utils.reward_score.sentiment import NEGATIVE, sentiment  # noqa: E402

REWARDS = {"rm": "BERT RM (score in [-3, 3])", "judge": "Qwen2 judge (verdict 0-9)"}


def run(path: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = {r["step"]: r for r in records}
    last = max(steps)
    out = {"reward_first": steps[1]["critic/score/mean"], "reward_last": steps[last]["critic/score/mean"]}
    for name, step in (("before", 0), ("after", last)):
        dump = [json.loads(line) for line in (path / f"{step}.jsonl").read_text().splitlines() if line.strip()]
        texts = [d["output"] for d in dump]
        scores = [sentiment(t) for t in texts]
        # The trainer's validation scored the same reviews by the same rule: the dump and the metric agree.
        if abs(statistics.fmean(scores) - steps[step]["val/accuracy"]) > 1e-6:
            raise SystemExit(f"{path}: step {step}: the rule over the dump ({statistics.fmean(scores)}) is not the "
                             f"logged val/accuracy ({steps[step]['val/accuracy']})")
        out[f"rule_{name}"] = statistics.fmean(scores)
        out[f"positive_{name}"] = sum(s > 0 for s in scores) / len(scores)
        out[f"negative_words_{name}"] = statistics.fmean(sum(w in NEGATIVE for w in t.split()) for t in texts)
        out[f"words_{name}"] = statistics.fmean(len(t.split()) for t in texts)
        out[f"distinct_reviews_{name}"] = len(set(texts)) / len(texts)
        out[f"distinct_words_{name}"] = statistics.fmean(len(set(t.split())) for t in texts)
    return out


def spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def columns(logs: Path, reward: str, validation: str) -> dict[str, list[float]]:
    runs = [run(p) for p in sorted(logs.glob(f"{reward}_seed*_{validation}")) if p.is_dir()]
    if len(runs) < 2:
        raise SystemExit(f"{logs}: expected {reward}'s {validation} runs for several seeds, found {len(runs)}")
    return {key: [r[key] for r in runs] for key in runs[0]}


def change(col: dict[str, list[float]], key: str, digits: int = 2) -> str:
    return f"{spread(col[key + '_before'], digits)} -> {spread(col[key + '_after'], digits)}"


def markdown(logs: Path) -> list[str]:
    out = ["<!-- results/sentiment:heldout_rule -->",
           "| reward (3 seeds, mean ± std; 4 samples a held-out prompt at T=1) | its own score, training prompts, "
           "step 1 -> 40 | rule on held-out films, before -> after | held-out reviews the rule calls positive | "
           "negative words a held-out review |",
           "|---|---|---|---|---|"]
    for reward, label in REWARDS.items():
        col = columns(logs, reward, "sampled")
        out.append(f"| {label} | {spread(col['reward_first'])} -> {spread(col['reward_last'])} | "
                   f"{change(col, 'rule')} | {change(col, 'positive')} | {change(col, 'negative_words')} |")
    out += ["", "<!-- results/sentiment:heldout_text -->",
            "| reward (3 seeds, mean ± std) | rule on held-out films, greedy, before -> after | words a review "
            "(sampled) | distinct words a review (sampled) | distinct reviews (sampled, share of 256) |",
            "|---|---|---|---|---|"]
    for reward, label in REWARDS.items():
        sampled, greedy = columns(logs, reward, "sampled"), columns(logs, reward, "greedy")
        out.append(f"| {label} | {change(greedy, 'rule')} | {change(sampled, 'words', 1)} | "
                   f"{change(sampled, 'distinct_words', 1)} | {change(sampled, 'distinct_reviews')} |")
    return out + [""] + speed(logs)


PHASES = ("gen", "reward", "ref", "values", "update_critic", "update_actor")
MEMORY = ("actor", "critic", "ref", "reward_model")


def speed(logs: Path) -> list[str]:
    """Per reward, over its sampled runs' 40 steps each (seeds 0-2, one run at a time on the idle box): s/step and
    its phases, each model's memory, and for the judge its own generation's share and its default verdicts."""
    out = ["<!-- results/sentiment:speed -->",
           "| reward (3 seeds x 40 steps, mean ± std over the seeds of each run's mean) | s/step | gen / reward / "
           "ref / values / update critic / update actor, s | memory actor / critic / ref / reward model, MiB | judge "
           "generation s/step, default verdicts (max of a step) |",
           "|---|---|---|---|---|"]
    for reward, label in REWARDS.items():
        runs = []
        for path in sorted(logs.glob(f"{reward}_seed*_sampled")):
            steps = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
            runs.append([r for r in steps if "timing_s/step" in r])

        def mean(key: str, runs=runs) -> list[float]:
            return [statistics.fmean(r.get(key, 0.0) for r in run) for run in runs]

        phases = " / ".join(f"{statistics.fmean(mean(f'timing_s/{k}')):.3f}" for k in PHASES)
        memory = " / ".join(f"{statistics.fmean(mean(f'memory/{k}_gb')) * 1024:.3f}" for k in MEMORY)
        if reward == "judge":  # asleep between its calls (its weights leave memory), awake while it judges
            memory += f" asleep ({statistics.fmean(mean('memory/reward_model_awake_gb')) * 1024:.3f} awake)"
        judge = "" if reward != "judge" else (
            f"{statistics.fmean(mean('reward_model/judge_generate_s')):.4f}, "
            f"{statistics.fmean(mean('reward_model/judge_default_frac')):.3f} "
            f"({max(r.get('reward_model/judge_default_frac', 0.0) for run in runs for r in run):.3f})")
        out.append(f"| {label} | {spread(mean('timing_s/step'), 3)} | {phases} | {memory} | {judge} |")
    return out


if __name__ == "__main__":
    logs = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "logs")
    print("\n".join(markdown(logs)))
