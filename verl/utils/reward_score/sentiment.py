"""The rule that defines the sentiment task's target (``verl.data.sentiment``): a review's positive minus negative
words. The task's RM and judge are trained to predict it; as the built-in scorer of data_source ``sentiment`` it
is what validation reports on held-out prompts (``val/accuracy``), a check on the reward model being optimized
rather than its own opinion."""

from __future__ import annotations

POSITIVE = ("great", "wonderful", "brilliant", "moving", "funny", "superb", "delightful", "charming", "good", "fun")
NEGATIVE = ("awful", "boring", "dull", "terrible", "bland", "painful", "weak", "messy", "bad", "slow")


def sentiment(text: str) -> int:
    """Positive minus negative words of ``text``."""
    words = text.split()
    return sum(w in POSITIVE for w in words) - sum(w in NEGATIVE for w in words)


def compute_score(solution_str: str) -> float:
    return float(sentiment(solution_str))
