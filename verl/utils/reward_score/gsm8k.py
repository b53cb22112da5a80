"""GSM8K reward: the final answer follows ``#### `` (strict) or is the last number (flexible)."""

from __future__ import annotations

import re

# Regex matching over a very long generation is slow; the answer is at the end anyway.
_SOLUTION_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer of ``solution_str``, or None.

    strict: the last ``#### <number>`` (commas and dollar signs removed), checking the format too;
    flexible: the last number-like token that is not just ``.``.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k.extract_solution: expected method 'strict' or 'flexible', found {method!r}")
    tail = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_NUMBER.findall(tail)):
        if candidate not in ("", "."):
            return candidate
    return None


def compute_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """``score`` if the extracted answer equals ``ground_truth``, ``format_score`` if an answer was
    found but is wrong, 0 if none was found."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score
