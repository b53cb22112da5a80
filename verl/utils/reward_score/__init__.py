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


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> float:
    """Score ``solution_str`` with the built-in scorer for ``data_source``."""
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


__all__ = ["default_compute_score", "load_reward_fn", "RewardFunctionError"]
