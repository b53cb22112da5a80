"""Exact-match reward for the quickstart arithmetic task (prompts like ``37+48=``)."""

from __future__ import annotations

import re

# The answer is an optional minus sign and digits, read from the start of the answer text; anything
# else (a space, another operator, eos text) ends it.
_ANSWER = re.compile(r"\s*(-?\d+)")


def extract_answer(solution_str: str) -> str | None:
    """The integer written right after ``=`` (or at the start, when the prompt is not included)."""
    answer_text = solution_str.split("=", 1)[1] if "=" in solution_str else solution_str
    match = _ANSWER.match(answer_text)
    return match.group(1) if match else None


def compute_score(solution_str: str, ground_truth: str | int, extra_info: dict | None = None) -> float:
    """1.0 if the extracted answer equals ``ground_truth`` as an integer, else 0.0."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    # Compared as canonical decimal strings, not int(): Python refuses to parse more than 4300 digits, and a
    # sampled answer may be that long.
    return 1.0 if _canonical(answer) == _canonical(str(ground_truth).strip()) else 0.0


def _canonical(number: str) -> str:
    negative, digits = number.startswith("-"), number.lstrip("+-").lstrip("0") or "0"
    return "-" + digits if negative and digits != "0" else digits
