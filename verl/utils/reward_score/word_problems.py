"""Reward for the generated word problems (``verl data word-problems``): the first final-answer marker.

The prompt asks for ``The answer is N.``; GSM8K's ``#### N`` counts too. The *first* marker is the answer
(a response that states one number and then argues for another gets nothing for the second), compared as a
number with the ground truth (commas and a dollar sign dropped, ``12.0`` equals ``12``). No marker: 0.
"""

from __future__ import annotations

import re

# Regex matching over a very long generation is slow; the problems' answers come early.
_SOLUTION_CLIP_CHARS = 600
_MARKER = re.compile(r"(?:the answer is|####)\s*:?\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)", re.IGNORECASE)


def extract_answer(solution_str: str) -> str | None:
    """The number after the first ``The answer is`` / ``####`` in ``solution_str`` (commas removed), or None."""
    match = _MARKER.search(solution_str[:_SOLUTION_CLIP_CHARS])
    return match.group(1).replace(",", "") if match else None


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("$", "").strip())
    except ValueError:
        return None


def compute_score(solution_str: str, ground_truth: str | int, format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` if the first answer marker's number equals ``ground_truth``, ``format_score`` if there is a
    marker with another number, 0 without one."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    got, want = _as_number(answer), _as_number(str(ground_truth))
    return score if got is not None and want is not None and got == want else format_score
