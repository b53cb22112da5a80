"""A reward model the training engines do not build (an encoder: BERT, DeBERTa-v2/v3, RoBERTa, ...): transformers'
own ``AutoModelForSequenceClassification`` on every rank, forward-only and unsharded. Every rank is its own DP
replica, so each scores its share of the batch."""

from __future__ import annotations

import torch

from verl.utils.device import get_device


class ReplicatedRewardModel:
    def __init__(self, path: str, micro_batch_size: int = 1, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForSequenceClassification
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.device = get_device()
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).eval().to(self.device)
        self.micro_batch_size = micro_batch_size

    def score(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B] the classifier's single logit per row (rows right-padded, ``attention_mask`` marks them)."""
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in batch]
        size = batch["input_ids"].shape[0]
        out = []
        with torch.no_grad():
            for start in range(0, size, self.micro_batch_size):
                part = {k: batch[k][start:start + self.micro_batch_size].to(self.device) for k in keys}
                out.append(self.model(**part).logits[:, 0].float().cpu())
        return torch.cat(out) if out else torch.zeros(0)
