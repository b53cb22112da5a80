"""verl's older import path of ``@function_tool``: the same module as :mod:`verl.tools.function_tool` (its registry,
decorator and loader are one object under both names)."""

import sys

from verl.tools import function_tool as _module

sys.modules[__name__] = _module
