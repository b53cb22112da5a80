"""Rule-based reward functions with verl's signature
``compute_score(data_source, solution_str, ground_truth, extra_info=None)``."""

from __future__ import annotations

from typing import Any

from verl.utils.reward_score import arithmetic, gsm8k, sentiment, word_problems
from verl.utils.reward_score.loader import RewardFunctionError, load_reward_fn

GSM8K_DATA_SOURCES = ("openai/gsm8k", "gsm8k")
ARITHMETIC_DATA_SOURCES = ("arithmetic",)
WORD_PROBLEM_DATA_SOURCES = ("word_problems", "calculator_word_problems")
SENTIMENT_DATA_SOURCES = ("sentiment",)
# Data sources whose answer is the model's final turn of a multi-turn (tool) rollout: the reward manager hands their
# scorer that turn's text only, so an answer stated before the tool calls, then left unstated, does not count.
LAST_TURN_DATA_SOURCES = ("calculator_word_problems",)
LAST_TURN_KEY = "reward_last_turn"  # extra_info[LAST_TURN_KEY] = true: the same for a row of any data source


def scores_last_turn(data_source: str, extra_info: Any = None) -> bool:
    """Whether a row is scored on the model's last turn only (see :data:`LAST_TURN_DATA_SOURCES`)."""
    return data_source in LAST_TURN_DATA_SOURCES or bool(isinstance(extra_info, dict) and extra_info.get(LAST_TURN_KEY))


# extra_info[STOP_KEY]: strings that end a completion (a few-shot prompt's next "Question:"); the scorer reads the
# text before the first of them, as lm-eval-harness's ``until`` cuts a base model's completion.
STOP_KEY = "stop"


def cut_at_stop(solution_str: str, extra_info: Any = None) -> str:
    """``solution_str`` up to the first of ``extra_info["stop"]`` (a string or a list of them), or whole."""
    stops = extra_info.get(STOP_KEY) if isinstance(extra_info, dict) else None
    if stops is None:
        return solution_str
    cut = len(solution_str)
    for stop in [stops] if isinstance(stops, str) else list(stops):
        where = solution_str.find(str(stop)) if stop else -1
        if where >= 0:
            cut = min(cut, where)
    return solution_str[:cut]


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> float:
    """Score ``solution_str`` (cut at ``extra_info["stop"]`` where a row sets it) with the built-in scorer for
    ``data_source``."""
    solution_str = cut_at_stop(solution_str, extra_info)
    if data_source in GSM8K_DATA_SOURCES:
        return float(gsm8k.compute_score(solution_str, ground_truth))
    if data_source in ARITHMETIC_DATA_SOURCES:
        return float(arithmetic.compute_score(solution_str, ground_truth, extra_info))
    if data_source in WORD_PROBLEM_DATA_SOURCES:
        return float(word_problems.compute_score(solution_str, ground_truth))
    if data_source in SENTIMENT_DATA_SOURCES:
        return sentiment.compute_score(solution_str)
    raise NotImplementedError(
        f"default_compute_score: no built-in reward for data_source {data_source!r}; expected one of "
        f"{list(GSM8K_DATA_SOURCES + ARITHMETIC_DATA_SOURCES + WORD_PROBLEM_DATA_SOURCES + SENTIMENT_DATA_SOURCES)}, "
        f"or set custom_reward_function.path"
    )


__all__ = ["cut_at_stop", "default_compute_score", "load_reward_fn", "RewardFunctionError", "scores_last_turn"]
