"""The actor's prompt + response re-encoded for a reward model with its own tokenizer (verl's
``_switch_chat_template``): each row's valid prompt and response tokens decoded with the actor's tokenizer (no
padding, no special tokens), the conversation rendered with the RM's chat template (user = the prompt, or the
dataset's own chat messages when the batch carries them as ``raw_prompt``; assistant = the response), encoded with
the RM's tokenizer; an encoder without a chat template reads the (prompt, response) text pair. A sequence longer
than ``max_length`` loses tokens from its left, i.e. from the start of the prompt; the rows that did are counted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def decode_rows(tokenizer: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                response_length: int) -> list[tuple[str, str]]:
    """(prompt text, response text) of each row of a rollout batch, from its valid tokens only (no padding, no
    special tokens)."""
    prompt_len = input_ids.shape[1] - response_length
    out = []
    for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
        prompt = [t for t, m in zip(ids[:prompt_len], mask[:prompt_len], strict=True) if m]
        response = [t for t, m in zip(ids[prompt_len:], mask[prompt_len:], strict=True) if m]
        out.append((tokenizer.decode(prompt, skip_special_tokens=True),
                    tokenizer.decode(response, skip_special_tokens=True)))
    return out


class Retokenizer:
    def __init__(self, actor_tokenizer: Any, rm_tokenizer: Any, template: str, max_length: int | None):
        if template not in ("chat", "pair"):
            raise ValueError(f"template: expected chat or pair, found {template!r}")
        self.actor_tokenizer = actor_tokenizer
        self.rm_tokenizer = rm_tokenizer
        self.template = template
        self.max_length = max_length
        pad = rm_tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0

    def texts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              response_length: int) -> list[tuple[str, str]]:
        return decode_rows(self.actor_tokenizer, input_ids, attention_mask, response_length)

    def _chat_ids(self, prompt: str | Sequence[dict], response: str) -> tuple[list[int], bool]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
            [dict(message) for message in prompt]
        messages.append({"role": "assistant", "content": response})
        text = self.rm_tokenizer.apply_chat_template(messages, tokenize=False)
        ids = list(self.rm_tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.max_length is not None and len(ids) > self.max_length:
            return ids[-self.max_length:], True
        return ids, False

    def _pair_ids(self, prompt: str, response: str) -> tuple[list[int], list[int] | None, bool]:
        full = self.rm_tokenizer(prompt, response, return_token_type_ids=True)
        if self.max_length is None or len(full["input_ids"]) <= self.max_length:
            return list(full["input_ids"]), full.get("token_type_ids"), False
        tokenizer = self.rm_tokenizer
        side = tokenizer.truncation_side
        tokenizer.truncation_side = "left"  # the prompt's start goes first
        try:
            try:
                cut = tokenizer(prompt, response, truncation="only_first", max_length=self.max_length,
                                return_token_type_ids=True)
            except Exception:  # noqa: BLE001 - the response alone is longer than max_length: cut both
                cut = tokenizer(prompt, response, truncation="longest_first", max_length=self.max_length,
                                return_token_type_ids=True)
        finally:
            tokenizer.truncation_side = side
        return list(cut["input_ids"]), cut.get("token_type_ids"), True

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int,
               raw_prompts: Sequence[Any] | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(the RM's batch: input_ids, attention_mask, position_ids [, token_type_ids], right-padded; truncated
        [B] bool). ``raw_prompts``: the dataset's prompts (chat messages or strings) per row, when carried."""
        rows, types, truncated = [], [], []
        for i, (prompt, response) in enumerate(self.texts(input_ids, attention_mask, response_length)):
            raw = raw_prompts[i] if raw_prompts is not None else None
            if raw is not None and not isinstance(raw, str):
                raw = list(raw)
            if self.template == "chat":
                ids, cut = self._chat_ids(raw if raw is not None else prompt, response)
                tt = None
            else:
                text = raw if isinstance(raw, str) else prompt
                if isinstance(raw, list):  # chat messages for an encoder: their contents in order
                    text = "\n".join(str(m["content"]) for m in raw)
                ids, tt, cut = self._pair_ids(text, response)
            rows.append(ids)
            types.append(tt)
            truncated.append(cut)
        width = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        batch = {"input_ids": ids, "attention_mask": mask,
                 "position_ids": (mask.cumsum(dim=1) - 1).clamp(min=0) * mask}
        if self.template == "pair" and all(t is not None for t in types):
            token_types = torch.zeros_like(ids)
            for i, row in enumerate(types):
                token_types[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            batch["token_type_ids"] = token_types
        return batch, torch.tensor(truncated, dtype=torch.bool)
