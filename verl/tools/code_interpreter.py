"""``code_interpreter(code)``: the model's Python run in the sandbox (:mod:`verl.tools.sandbox`), its output as the
tool's answer."""

from __future__ import annotations

from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.concurrency import LoopSemaphore
from verl.tools.sandbox import SandboxError, SandboxLimits, check_sandbox, run_python
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class CodeInterpreterTool(BaseTool):
    """``code_interpreter(code)``: runs the model's Python in the sandbox and returns its output.

    ``config`` keys (all optional): the fields of :class:`SandboxLimits` (``wall_seconds``, ``cpu_seconds``,
    ``memory_bytes``, ``max_processes``, ``max_output_bytes``, ``max_file_bytes``, ``tmp_bytes``, ``python``)
    and ``max_concurrency`` (sandboxes of this tool running at once on one event loop; default 4).

    Construction runs the start-up probe (:func:`~verl.tools.sandbox.check_sandbox`): a host where the sandbox
    cannot run refuses the job in one line instead of answering every call with bwrap's error. A run that bwrap
    fails later raises :class:`SandboxError` (a tool error in the agent loop's metrics, logged).
    """

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema)
        fields = set(SandboxLimits.__dataclass_fields__)
        unknown = set(self.config) - fields - {"type", "max_concurrency"}
        if unknown:
            raise ValueError(f"code_interpreter config: unknown keys {sorted(unknown)} (known: {sorted(fields)})")
        self.limits = SandboxLimits(**{k: v for k, v in self.config.items() if k in fields})
        check_sandbox(self.limits)
        self._slots = LoopSemaphore(int(self.config.get("max_concurrency", 4)))

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({
            "type": "function",
            "function": {"name": "code_interpreter",
                         "description": "Run a Python program and return what it prints (no network, no files "
                                        "kept between calls).",
                         "parameters": {"type": "object", "required": ["code"], "properties": {
                             "code": {"type": "string", "description": "Python source; print the answer."}}}}})

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResponse(text="Error: 'code' must be a non-empty string"), 0.0, {"error": 1}
        async with self._slots:
            result = await run_python(code, self.limits)
        if result.sandbox_error is not None:
            raise SandboxError(result.sandbox_error)
        metrics = {"timed_out": int(result.timed_out), "returncode": result.returncode, "wall_s": result.wall_s}
        return ToolResponse(text=result.as_text()), 0.0, metrics
