"""verl's offline evaluation: ``python -m verl.trainer.main_eval KEY=VALUE ...`` (verl's Hydra keys).

    python -m verl.trainer.main_eval data.path=responses.parquet data.response_key=responses \\
        data.data_source_key=data_source data.reward_model_key=reward_model \\
        [custom_reward_function.path=my_reward.py custom_reward_function.name=compute_score]

Scores a parquet that ``verl.trainer.main_generation`` wrote: each row's responses (a list of strings) by its data
source's reward function -- ``custom_reward_function.path/name`` when set, else the built-in scorers
(:func:`verl.utils.reward_score.default_compute_score`) -- called as verl's job calls it,
``compute_score(data_source, response, ground_truth)`` with ``ground_truth`` from the row's reward-model column.
As verl: a row's score is the mean over its responses, and ``test_score/<data_source>`` the mean of its rows'
scores; the metrics are printed as one dict and the exit code is 0. Keys and defaults:
``verl/trainer/config/evaluation.yaml`` (verl's ``ray_kwargs`` is accepted and dropped: no Ray here). A problem with
the config, the data or the reward function is one line and exit 2.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from verl.errors import EXIT_INPUT_ERROR, InputError
from verl.trainer.config.loader import HYDRA_IGNORED, PACKAGED_CONFIG_DIR, Rule, compose, resolve_path, rule

CONFIG_NAME = "evaluation"
IGNORED = {**HYDRA_IGNORED, "ray_kwargs": "verl-hpc runs no Ray: the rows are scored in this process"}
RULES: dict[str, Rule] = {
    "data.path": rule(str),
    "custom_reward_function.path": rule(str, nullable=True),
    "custom_reward_function.name": rule(str),
}


class EvaluationDataError(InputError):
    """A responses parquet the evaluation cannot score; one line naming the row or column."""


def load_config(overrides: Sequence[str]) -> dict[str, Any]:
    cfg, base_dir = compose(PACKAGED_CONFIG_DIR, CONFIG_NAME, None, overrides, RULES, IGNORED)
    cfg["data"]["path"] = resolve_path(cfg["data"]["path"], base_dir)
    return cfg


def read_rows(cfg: dict[str, Any]) -> tuple[list, list, list]:
    """(responses, data sources, reward-model entries) of every row, their columns checked."""


    from verl.trainer.generation_job import read_parquet

    data = cfg["data"]
    path = data["path"]
    table = read_parquet(path, EvaluationDataError)
    columns = []
    for key in ("response_key", "data_source_key", "reward_model_key"):
        name = data[key]
        if name not in table.column_names:
            raise EvaluationDataError(f"data.{key}: expected a column {name!r} in {path}, found columns "
                                      f"{table.column_names}")
        columns.append(table.column(name).to_pylist())
    if table.num_rows == 0:
        raise EvaluationDataError(f"data.path: expected at least one row, found none in {path}")
    return columns[0], columns[1], columns[2]


def reward_function(cfg: dict[str, Any]) -> Callable:
    from verl.utils.reward_score import default_compute_score, load_reward_fn

    custom = cfg["custom_reward_function"]
    if custom["path"]:
        return load_reward_fn(custom["path"], custom["name"])
    return default_compute_score


def _score(value: Any, where: str) -> float:
    # verl's reward functions return a number or a dict with "score" (and extra fields).
    if isinstance(value, dict):
        value = value.get("score")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EvaluationDataError(f"{where}: expected the reward function to return a number (or a dict with "
                                  f"'score'), found {type(value).__name__} {value!r}")
    return float(value)


def evaluate(cfg: dict[str, Any]) -> dict[str, float]:
    """``test_score/<data_source>``: the mean over that source's rows of each row's mean response score."""
    responses, sources, reward_data = read_rows(cfg)
    compute_score = reward_function(cfg)
    per_source: dict[str, list[float]] = defaultdict(list)
    for i, (row_responses, source, reward) in enumerate(zip(responses, sources, reward_data, strict=True)):
        where = f"data.path: row {i}"
        if isinstance(row_responses, str):
            row_responses = [row_responses]
        if not isinstance(row_responses, list) or not row_responses \
                or not all(isinstance(r, str) for r in row_responses):
            raise EvaluationDataError(f"{where}: expected a non-empty list of response strings in "
                                      f"{cfg['data']['response_key']!r}, found {str(row_responses)[:80]!r}")
        if not isinstance(reward, dict) or "ground_truth" not in reward:
            raise EvaluationDataError(f"{where}: expected {{'ground_truth': ...}} in "
                                      f"{cfg['data']['reward_model_key']!r}, found {str(reward)[:80]!r}")
        try:
            scores = [_score(compute_score(source, r, reward["ground_truth"]), where) for r in row_responses]
        except NotImplementedError as err:  # default_compute_score: a data source with no built-in scorer
            raise EvaluationDataError(f"{where}: {str(err).splitlines()[0]}") from None
        per_source[str(source)].append(sum(scores) / len(scores))
    return {f"test_score/{source}": sum(rows) / len(rows) for source, rows in per_source.items()}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        metrics = evaluate(load_config(argv))
    except InputError as exc:
        print(f"main_eval: error: {exc}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    print(metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
