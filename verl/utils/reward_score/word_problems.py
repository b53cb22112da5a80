"""Reward for the generated word problems (``verl data word-problems``, ``verl data calculator-problems``): the
final answer marker.

The prompt asks to *end* with ``The answer is N.``; GSM8K's ``#### N`` counts too. The *last* marker of the whole
response is the answer (as verl's gsm8k scorer reads the last ``####``): an agent's response states its answer
after a few tool turns, however long they were, so nothing is clipped. It is compared as a number with the ground
truth (commas and a dollar sign dropped, ``12.0`` equals ``12``). No marker: 0. The reward manager hands this
scorer the model's own tokens only (``response_mask`` 1), so a tool result saying "The answer is N" is not read.
"""

from __future__ import annotations

import re

# Linear in the response's length (no nested quantifiers): a long response is read whole.
_MARKER = re.compile(r"(?:the answer is|####)\s*:?\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)", re.IGNORECASE)


def extract_answer(solution_str: str) -> str | None:
    """The number after the last ``The answer is`` / ``####`` in ``solution_str`` (commas removed), or None."""
    match = None
    for match in _MARKER.finditer(solution_str):  # noqa: B007 - the last one is kept
        pass
    return match.group(1).replace(",", "") if match else None


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("$", "").strip())
    except ValueError:
        return None


def compute_score(solution_str: str, ground_truth: str | int, format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` if the last answer marker's number equals ``ground_truth``, ``format_score`` if there is a
    marker with another number, 0 without one."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    got, want = _as_number(answer), _as_number(str(ground_truth))
    return score if got is not None and want is not None and got == want else format_score
