"""Load a user's reward function by built-in name or from a Python file.

Loading a file **executes that file's code** in this process with this process's permissions:
only point ``custom_reward_function.path`` at code you trust.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

from verl.errors import InputError


class RewardFunctionError(InputError):
    """A reward function that cannot be found or loaded."""


def load_reward_fn(name_or_path: str | None, function_name: str = "compute_score") -> Callable:
    """Return a ``compute_score(data_source, solution_str, ground_truth, extra_info)`` callable.

    ``name_or_path``: None or "default" -> :func:`default_compute_score` (dispatch on data_source);
    a built-in scorer name ("arithmetic", "gsm8k", "word_problems") -> that scorer for every data_source;
    otherwise a path to a .py file whose top-level ``function_name`` is returned (the file is executed).
    """
    from verl.utils.reward_score import (
        ARITHMETIC_DATA_SOURCES,
        GSM8K_DATA_SOURCES,
        WORD_PROBLEM_DATA_SOURCES,
        default_compute_score,
    )

    if name_or_path in (None, "", "default"):
        return default_compute_score
    builtins = {"arithmetic": ARITHMETIC_DATA_SOURCES[0], "gsm8k": GSM8K_DATA_SOURCES[0],
                "word_problems": WORD_PROBLEM_DATA_SOURCES[0]}
    if name_or_path in builtins:
        # A partial of a module-level function, so the scorer pickles (reward.num_workers' spawned processes).
        return functools.partial(_builtin_score, builtins[name_or_path])
    path = os.path.abspath(os.path.expanduser(name_or_path))
    if not os.path.isfile(path):
        raise RewardFunctionError(
            f"reward function: expected a built-in name {sorted(builtins)} or an existing .py file, "
            f"found no file at {path}"
        )
    module_name = "verl_custom_reward_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardFunctionError(f"reward function: cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise RewardFunctionError(f"reward function: importing {path} failed: {type(err).__name__}: {err}") from err
    return FileRewardFunction(path, function_name, _get_function(module, function_name, path))


def _builtin_score(scorer_source, data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    from verl.utils.reward_score import default_compute_score

    return default_compute_score(scorer_source, solution_str, ground_truth, extra_info)


class FileRewardFunction:
    """A function loaded from a user's file: calls it, and pickles as (path, name) so that a spawned process
    (``reward.num_workers``) loads the file again instead of looking up a module only this process has."""

    def __init__(self, path: str, name: str, fn: Callable):
        self.path, self.name, self.fn = path, name, fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        return load_reward_fn, (self.path, self.name)


def _get_function(module, function_name: str, where: str) -> Callable:
    fn = getattr(module, function_name, None)
    if not callable(fn):
        found = "nothing" if fn is None else type(fn).__name__
        raise RewardFunctionError(f"reward function: expected a function '{function_name}' in {where}, found {found}")
    return fn
