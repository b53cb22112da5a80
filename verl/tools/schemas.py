"""Tool schemas in OpenAI's function-calling format and the tool response, as verl's ``verl.tools.schemas``.

Pydantic models (as verl's are), so a verl user's ``OpenAIFunctionToolSchema.model_validate(...)`` and
``ToolResponse(text=...)`` work unchanged.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# JSON-schema keywords these models do not name (minimum, maximum, pattern, additionalProperties, minItems, ...)
# are kept, not dropped: they are part of the contract the caller wrote, and the chat template shows the model them.
_KEEP_UNNAMED_KEYWORDS = ConfigDict(extra="allow")


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter: its JSON type (a list of types for a union), description and allowed values."""

    model_config = _KEEP_UNNAMED_KEYWORDS

    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None
    items: dict[str, Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    model_config = _KEEP_UNNAMED_KEYWORDS

    type: str = "object"
    properties: dict[str, OpenAIFunctionPropertySchema] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    model_config = _KEEP_UNNAMED_KEYWORDS

    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=OpenAIFunctionParametersSchema)
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    model_config = _KEEP_UNNAMED_KEYWORDS

    type: str
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    """A call as the parser found it: the arguments are still the model's JSON text."""

    name: str
    arguments: str


class OpenAIFunctionCallSchema(BaseModel):
    name: str
    arguments: dict[str, Any]

    @staticmethod
    def from_openai_function_parsed_schema(parsed: OpenAIFunctionParsedSchema) -> tuple[OpenAIFunctionCallSchema, bool]:
        """(call, has_decode_error): arguments that are not a JSON object become ``{}`` with the flag set."""
        try:
            arguments = json.loads(parsed.arguments)
        except (ValueError, TypeError, RecursionError):  # bad JSON, a number past the digit limit, deep nesting
            return OpenAIFunctionCallSchema(name=parsed.name, arguments={}), True
        if not isinstance(arguments, dict):
            return OpenAIFunctionCallSchema(name=parsed.name, arguments={}), True
        return OpenAIFunctionCallSchema(name=parsed.name, arguments=arguments), False


class OpenAIFunctionToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a tool returns to the model: text, and (for multimodal tools) lists of images / videos."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _media_are_lists(cls, values):
        if isinstance(values, dict):
            for key in ("image", "video"):
                if values.get(key) is not None and not isinstance(values[key], list):
                    raise ValueError(f"ToolResponse.{key} must be a list (wrap a single item: [{key}])")
        return values

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video
