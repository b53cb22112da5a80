"""The one base of every error about the user's input.

:class:`InputError` covers what the user gave us and can fix: a config key or value, a data file, a model or
checkpoint directory, a command-line argument, a parallel layout the model cannot be split over. Entry points
(``verl <command>``, ``verl train``'s ranks, the quickstart) print it as one line and exit 2. Any other
exception is an internal error: its traceback goes to a log, the console gets one line naming the exception
and that log, and the exit code is 1 — a ``ValueError`` from inside torch is the program's fault, not the
user's.

It derives from ``ValueError`` so that code catching ``ValueError`` around a validation (ours and verl
users') keeps working.
"""

import argparse


class InputError(ValueError):
    """Bad input from the user: one line naming what was expected and what was found."""


class OutputExistsError(InputError, FileExistsError):
    """An output path that already exists where a command would write a new one (``--out`` of convert, export)."""


class InputFileNotFoundError(InputError, FileNotFoundError):
    """A file the configuration names that does not exist (verl raises ``FileNotFoundError`` there)."""


class InputModuleNotFoundError(InputError, ModuleNotFoundError):
    """A module the configuration names (a tool's ``class_name``) that cannot be imported (verl raises the
    ``ModuleNotFoundError`` itself)."""


# The exit codes of every entry point (``verl <command>``, ``verl train``'s ranks, the benches, the quickstart).
EXIT_INTERNAL_ERROR = 1
EXIT_INPUT_ERROR = 2


def exit_code(err: BaseException) -> int:
    """The exit code an entry point ends with for ``err``: 2 for the user's input, 1 for anything else."""
    return EXIT_INPUT_ERROR if isinstance(err, InputError) else EXIT_INTERNAL_ERROR


def refuse(prog: str, message: object) -> int:
    """Bad input: ``prog: message`` as one line on stderr; returns its exit code (``return refuse(...)``)."""
    import sys

    text = (str(message).strip().splitlines() or [""])[0]
    print(f"{prog}: {text}", file=sys.stderr)
    return EXIT_INPUT_ERROR


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are bad input like any other: ``error_type`` (an :class:`InputError`) raised
    with argparse's one-line message, which the entry point prints as one line with exit 2, instead of argparse's
    usage text."""

    def __init__(self, *args, error_type: type[InputError] = InputError, **kwargs):
        super().__init__(*args, **kwargs)
        self.error_type = error_type

    def error(self, message):
        raise self.error_type(message)
