"""Token-exact trajectories: the model's tokens as sampled, other messages as chat-template deltas.

A trajectory is ``prompt_ids`` then, turn after turn, the tokens the model sampled (mask 1, with their
log-probs) and the tokens of the messages added between turns (tool results, user turns; mask 0). The added
tokens are the template's *delta*: ``render(history + new, add_generation_prompt=True)`` minus
``render(history)``. Nothing already in the trajectory is ever re-rendered, so a template that rewrites past
turns (Qwen3 drops the ``<think>`` of earlier turns) cannot change the tokens that are trained.

Two details make the delta exact:

* the turn separator after the model's stop token: ChatML renders an assistant turn as
  ``...<|im_end|>\\n`` but the model stops at ``<|im_end|>``; the ``\\n`` (verl #6921's dropped separator) is
  found by rendering a sentinel assistant turn and taking what the template writes after the model's last
  token;
* templates whose rendering of the history is not a prefix of the rendering of the longer conversation (a new
  user turn makes Qwen3 drop earlier reasoning): the delta is then taken against a fixed two-message history,
  which renders the new messages the same way.
"""

from __future__ import annotations

from typing import Any

_SENTINEL = "\u2063SENTINEL\u2063"  # never produced by a model, survives any template


class ChatTemplateError(ValueError):
    """The template cannot render the new messages as an appendable delta."""


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False,
           **template_kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **template_kwargs)


def encode(tokenizer, text: str) -> list[int]:
    # the template already wrote every special token (BOS included): none may be added again
    return list(tokenizer.encode(text, add_special_tokens=False))


def turn_closing_text(tokenizer, tools: list[dict] | None = None, **template_kwargs: Any) -> str:
    """What the template writes after an assistant turn's content (ChatML ``<|im_end|>\\n``, Llama-3
    ``<|eot_id|>``)."""
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
    text = render(tokenizer, messages, tools, **template_kwargs)
    at = text.rfind(_SENTINEL)
    if at < 0:
        raise ChatTemplateError("the chat template does not render an assistant message's content")
    return text[at + len(_SENTINEL):]


def missing_separator(generated_text: str, closing: str) -> str:
    """The part of ``closing`` the model did not write itself: what follows its stop token in the template.

    The model's text ends with some prefix of ``closing`` (``<|im_end|>`` of ``<|im_end|>\\n``), or with none
    of it (stopped by length or a stop string: the whole closing is added)."""
    for k in range(len(closing), 0, -1):
        if generated_text.endswith(closing[:k]):
            return closing[k:]
    return closing


def message_delta(tokenizer, history: list[dict], new: list[dict], tools: list[dict] | None = None,
                  **template_kwargs: Any) -> str:
    """The text the template adds for ``new`` after ``history`` (ending with the generation prompt)."""
    before = render(tokenizer, history, tools, **template_kwargs)
    after = render(tokenizer, history + new, tools, add_generation_prompt=True, **template_kwargs)
    if after.startswith(before):
        return after[len(before):]
    # unstable history (past turns re-rendered differently): the new messages after a fixed short history
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    if history and history[0].get("role") == "system":
        base = [history[0]] + base
    before = render(tokenizer, base, tools, **template_kwargs)
    after = render(tokenizer, base + new, tools, add_generation_prompt=True, **template_kwargs)
    if not after.startswith(before):
        raise ChatTemplateError("the chat template renders earlier messages differently once new ones follow "
                                "them, even for a fixed history: it cannot extend a trajectory token-exactly")
    return after[len(before):]


class Trajectory:
    """One conversation's tokens as the model saw them, with the mask and log-probs of the response part."""

    def __init__(self, tokenizer, messages: list[dict], tools: list[dict] | None = None, **template_kwargs: Any):
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template_kwargs = template_kwargs
        self.messages = list(messages)
        self.prompt_ids = encode(tokenizer, render(tokenizer, self.messages, self.tools, add_generation_prompt=True,
                                                   **template_kwargs))
        self.response_ids: list[int] = []
        self.response_mask: list[int] = []
        self.response_logprobs: list[float] = []
        self.has_logprobs = True
        self._closing: str | None = None
        self._last_model_text = ""

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def append_model_tokens(self, token_ids: list[int], logprobs: list[float] | None) -> str:
        """The sampled tokens, unchanged (mask 1); returns their text (special tokens kept)."""
        token_ids = list(token_ids)
        if logprobs is None:
            self.has_logprobs = False
            logprobs = [0.0] * len(token_ids)
        elif len(logprobs) != len(token_ids):
            raise ValueError(f"the server returned {len(logprobs)} log-probs for {len(token_ids)} tokens")
        self.response_ids += token_ids
        self.response_mask += [1] * len(token_ids)
        self.response_logprobs += [float(x) for x in logprobs]
        self._last_model_text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        return self._last_model_text

    def delta_ids(self, new_messages: list[dict]) -> list[int]:
        """The tokens that ``append_messages(new_messages)`` would add, without adding them."""
        if self._closing is None:
            self._closing = turn_closing_text(self.tokenizer, self.tools, **self.template_kwargs)
        text = ""
        if self.response_ids and self.messages and self.messages[-1].get("role") == "assistant":
            text = missing_separator(self._last_model_text, self._closing)
        text += message_delta(self.tokenizer, self.messages, new_messages, self.tools, **self.template_kwargs)
        return encode(self.tokenizer, text)

    def append_messages(self, new_messages: list[dict], ids: list[int] | None = None) -> list[int]:
        """Tool / user messages as template deltas (mask 0, log-prob 0); returns the tokens added."""
        ids = self.delta_ids(new_messages) if ids is None else ids
        self.messages += new_messages
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.response_logprobs += [0.0] * len(ids)
        return ids
