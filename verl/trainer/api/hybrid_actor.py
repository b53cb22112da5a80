"""One actor that generates and trains, as in the documents:

    actor = HybridActor.from_pretrained(path, tokenizer=tok_path, learning_rate=1e-3)
    out = actor.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    actor.train()
    loss = actor(input_ids=ids, labels=ids).loss       # one optimizer step of the training engine
    actor.eval()
    loss = actor(input_ids=ids, labels=ids).loss       # the same loss, no step

It is `verl train`'s actor worker (:class:`verl.workers.actor_rollout_ref_worker.ActorRolloutRefWorker`, through its
worker group): the weights live in the training engine (Megatron or FSDP, ``strategy``); ``generate`` reshards them
into the rollout engine through the 3D-HybridEngine and releases the rollout's copy afterwards, so a generation after
an optimizer step samples from the updated weights and no second copy stays resident between calls.

The training engine fuses forward, backward and the optimizer step (its ``train_step``), so in training mode a call
*is* a step: ``actor(input_ids=..., labels=...)`` returns the step's token-mean negative log-likelihood of the
labels (HF's convention: ``labels[t]`` predicted from the tokens before ``t``; ``-100`` ignored). In eval mode the
same loss comes from a forward pass only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from verl.errors import InputError

IGNORE_INDEX = -100


@dataclasses.dataclass
class ActorOutput:
    loss: Any  # a 0-d float tensor
    metrics: dict[str, float]


class HybridActor:
    """Build with :meth:`from_pretrained`."""

    def __init__(self, worker_group: Any, tokenizer: Any, config: Any, max_new_tokens: int,
                 tokenizer_path: str | None = None):
        self.worker_group, self.tokenizer, self.config = worker_group, tokenizer, config
        self.max_new_tokens = max_new_tokens
        self.tokenizer_path = tokenizer_path
        self.training = True

    @classmethod
    def from_pretrained(cls, path: str, tokenizer: str | None = None, *, learning_rate: float = 1e-5,
                        strategy: str = "megatron", max_prompt_length: int = 64, max_new_tokens: int = 64,
                        max_batch_rows: int = 64, seed: int = 1, overrides: Mapping[str, Any] | None = None
                        ) -> HybridActor:
        """The actor of the HF model at ``path`` (a directory, or a config.json for a seeded random init), its
        tokenizer at ``tokenizer`` (default: ``path``). ``overrides``: further ``actor_rollout_ref.*`` keys, dotted
        (``{"rollout.name": "sglang"}``). torch.distributed as `verl train`'s rank (a world of one outside a
        launcher)."""
        import torch.distributed as dist
        from transformers import AutoTokenizer

        from verl.launcher.env import discover
        from verl.single_controller import WorkerGroup
        from verl.trainer.config.sections import PPOSections
        from verl.trainer.prepare import ensure_distributed, resolve_config
        from verl.workers.actor_rollout_ref_worker import ActorRolloutRefWorker

        world = dist.get_world_size() if dist.is_initialized() else discover().world_size
        # The batch keys only satisfy the config's divisibility rules: each call passes its own batch.
        arr: dict[str, Any] = {"model": {"path": path},
                               "rollout": {"name": "native", "n": 1, "log_prob_micro_batch_size_per_gpu": 1},
                               "actor": {"strategy": strategy, "optim": {"lr": learning_rate},
                                         "ppo_mini_batch_size": world, "ppo_micro_batch_size_per_gpu": 1}}
        for dotted, value in (overrides or {}).items():
            node = arr
            *parents, leaf = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        tree = {"actor_rollout_ref": arr,
                # No data is read (data_pending): the file name only satisfies the config's schema.
                "data": {"train_files": "hybrid_actor_reads_no_data.parquet", "tokenizer": tokenizer or path,
                         "max_prompt_length": max_prompt_length,
                         "max_response_length": max_new_tokens, "train_batch_size": world},
                "trainer": {"nnodes": 1, "n_gpus_per_node": world, "seed": seed}}
        config = resolve_config(tree, data_pending=True)
        ensure_distributed(config)
        tok = AutoTokenizer.from_pretrained(tokenizer or path)
        sections = PPOSections.from_tree(config, "")
        wg = WorkerGroup(ActorRolloutRefWorker, sections.actor_rollout_ref, "actor_rollout", 1 << 20, tok, seed=seed,
                         bucket_bytes=sections.hybrid_engine.bucket_bytes, response_length=max_new_tokens,
                         max_seq_len=max_prompt_length + max_new_tokens, max_batch_rows=max_batch_rows,
                         name="actor_rollout_ref")
        return cls(wg, tok, config, max_new_tokens, tokenizer or path)

    @property
    def worker(self) -> Any:
        """This rank's actor worker (its ``actor.engine``: the training engine; ``hybrid_engine``; ``rollout``)."""
        return self.worker_group.worker

    def save_pretrained(self, out_dir: str) -> str:
        """The actor's current weights (after its optimizer steps) as an HF directory at ``out_dir``, with its
        tokenizer; every rank calls it (rank 0 writes). Returns ``out_dir``."""
        import os

        out_dir = os.path.abspath(out_dir)
        self.worker.actor.engine.export_hf(self.config.actor_rollout_ref.model.path, out_dir, self.tokenizer)
        return out_dir

    def train(self, mode: bool = True) -> HybridActor:
        self.training = bool(mode)
        return self

    def eval(self) -> HybridActor:
        return self.train(False)

    # ------------------------------------------------------------------ generation
    def generate(self, input_ids: Any, attention_mask: Any = None, max_new_tokens: int | None = None,
                 do_sample: bool = True, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 seed: int | None = None, **unused: Any) -> Any:
        """Prompts (left-padded ``input_ids`` [B, P]) + their continuations [B, P + R] (pad after an eos), sampled by
        the rollout engine from the training engine's current weights."""
        import torch

        from verl.protocol import DataProto

        if unused:
            raise InputError(f"generate: unexpected arguments {sorted(unused)}")
        new_tokens = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if not 1 <= new_tokens <= self.max_new_tokens:
            raise InputError(f"generate(max_new_tokens={new_tokens}): expected 1..{self.max_new_tokens} "
                             "(from_pretrained's max_new_tokens)")
        input_ids = torch.as_tensor(input_ids)
        mask = torch.ones_like(input_ids) if attention_mask is None else torch.as_tensor(attention_mask)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        prompts = DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask, "position_ids": positions},
                                      meta_info={"seed": seed, "eos_token_id": self.tokenizer.eos_token_id,
                                                 "pad_token_id": self.tokenizer.pad_token_id})
        worker = self.worker
        sampling = worker.train_sampling
        worker.train_sampling = dataclasses.replace(sampling, n=1, do_sample=bool(do_sample),
                                                    temperature=float(temperature), top_p=float(top_p),
                                                    top_k=int(top_k), response_length=new_tokens)
        try:
            self.worker_group.update_weights()
            out = self.worker_group.generate_sequences(prompts)
        finally:
            worker.train_sampling = sampling
        out.meta_info.pop("metrics", None)
        return torch.cat([input_ids, out.batch["responses"].to(input_ids.dtype)], dim=1)

    # ------------------------------------------------------------------ training
    def __call__(self, input_ids: Any, labels: Any = None, attention_mask: Any = None) -> ActorOutput:
        """The token-mean NLL of ``labels`` (default: ``input_ids``) through the training engine: in training mode
        one optimizer step on it (every rank passes the same batch), in eval mode a forward pass."""
        import torch

        from verl.trainer.sft_trainer import sft_loss

        input_ids = torch.as_tensor(input_ids)
        labels = input_ids if labels is None else torch.as_tensor(labels)
        if labels.shape != input_ids.shape:
            raise InputError(f"labels: expected the shape of input_ids {tuple(input_ids.shape)}, found "
                             f"{tuple(labels.shape)}")
        mask = torch.ones_like(input_ids) if attention_mask is None else torch.as_tensor(attention_mask)
        targets = labels[:, 1:]
        response_mask = ((targets != IGNORE_INDEX) & mask[:, 1:].bool()).to(torch.int64)
        batch = {"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                 "responses": torch.where(targets == IGNORE_INDEX, input_ids[:, 1:], targets),
                 "response_mask": response_mask}
        worker = self.worker
        worker.rollout_side.release()  # the rollout's copy of older weights would be stale after a step
        actor, rows = worker.actor, input_ids.shape[0]
        if self.training:
            metrics = actor.engine.train_step(batch, rows, actor.engine.token_log_probs(False), sft_loss)
            return ActorOutput(torch.tensor(float(metrics["loss"])), dict(metrics))
        out = actor.engine.forward(batch, rows, actor.engine.token_log_probs(False))
        loss = sft_loss(out, batch)[0].detach()
        return ActorOutput(loss, {"loss": float(loss)})
