"""A calculator tool: arithmetic expressions evaluated on their syntax tree (never ``eval``).

Numbers, ``+ - * / // % **``, unary signs and parentheses; anything else (names, calls, attributes) is refused
with a message to the model. Powers and results are bounded so that ``9**9**9`` cannot hang a rollout.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 500
MAX_RESULT_DIGITS = 1000  # integers beyond this are refused: exact answers the model cannot use anyway


class CalculatorError(ValueError):
    """An expression the calculator refuses; its message goes back to the model."""


def _check_size(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_RESULT_DIGITS * 3.33:
        raise CalculatorError(f"result has more than {MAX_RESULT_DIGITS} digits")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            # bound the work before doing it: int ** int grows to about exponent * bits(base) bits
            if isinstance(right, (int, float)) and abs(right) > 10000:
                raise CalculatorError("exponent too large")
            big = MAX_RESULT_DIGITS * 3.33
            if isinstance(left, int) and isinstance(right, int) and right * left.bit_length() > big:
                raise CalculatorError(f"result has more than {MAX_RESULT_DIGITS} digits")
        try:
            return _check_size(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    raise CalculatorError(f"unsupported syntax: {type(node).__name__} (numbers and + - * / // % ** only)")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression, or ``CalculatorError``."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"syntax error: {e.msg}") from None
    return _eval(tree)


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value)


class CalculatorTool(BaseTool):
    """``calculator(expression)``: the exact value of an arithmetic expression."""

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({
            "type": "function",
            "function": {"name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
                         "parameters": {"type": "object", "required": ["expression"], "properties": {
                             "expression": {"type": "string",
                                            "description": "e.g. (1234 * 5678) - 91; + - * / // % ** ()"}}}}})

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        expression = parameters.get("expression")
        if not isinstance(expression, str):
            return ToolResponse(text="Error: 'expression' must be a string"), 0.0, {"error": 1}
        try:
            return ToolResponse(text=format_number(evaluate(expression))), 0.0, {"error": 0}
        except CalculatorError as e:
            return ToolResponse(text=f"Error: {e}"), 0.0, {"error": 1}
