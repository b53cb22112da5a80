"""One rank of `verl train` with a weight-parity check after every push to SGLang (run under
.venv-sglang by test_sglang_trainer.py, each rank started by ``python -m verl.launcher.spawn``).

After each ``update_weights`` (reshard + push) and before the step generates, the owner of the first
rollout group asks SGLang for greedy answers to a few fixed prompts; every rank then runs the Megatron
actor forward on those sequences and checks that each generated token is the argmax of Megatron's
logits at its position (greedy parity, token by token) and that SGLang's greedy log-probs equal
Megatron's. Rank 0 appends one JSON line per push to ``$VERL_PARITY_OUT``:
``{"push": k, "tokens": n, "mismatches": m, "max_logprob_diff": d}``.
"""

import functools
import json
import os
import sys

import torch
import torch.distributed as dist

PROMPTS = ["12+34=", "7+8=", "50+49=", "3+66="]


def megatron_greedy_check(worker, gen: dict) -> tuple[int, int, float]:
    """(response tokens, tokens that are not Megatron's argmax, max |SGLang - Megatron| log-prob)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from verl.engine.megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy
    from verl.engine.padding import restore

    engine = worker.actor.engine
    vocab = engine.config.vocab_size
    response_length = gen["responses"].size(1)

    def output_fn(logits, aligned_ids, shifts, micro_batch):
        targets = torch.roll(aligned_ids, shifts=-1, dims=1)
        log_probs, _ = vocab_parallel_log_probs_and_entropy(logits, targets, vocab, False)
        full = gather_from_tensor_model_parallel_region(logits)[..., :vocab]
        argmax = full.argmax(dim=-1)
        window = slice(-response_length - 1, -1)
        return {"argmax": restore(argmax, shifts)[:, window], "log_probs": restore(log_probs, shifts)[:, window]}

    batch = {k: gen[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    with torch.no_grad():
        out = engine.forward(batch, micro_batch_size=len(PROMPTS), output_fn=output_fn)
    mask = gen["response_mask"].bool()
    mismatches = int(((out["argmax"] != gen["responses"]) & mask).sum())
    diff = (out["log_probs"].float() - gen["rollout_log_probs"]).abs()[mask]
    return int(mask.sum()), mismatches, float(diff.max()) if diff.numel() else 0.0


def install_check(out_path: str) -> None:
    from verl.engine.rollout.base import SamplingParams
    from verl.workers.actor_rollout_ref_worker import ActorRolloutRefWorker

    original = ActorRolloutRefWorker.update_weights
    pushes = [0]

    @functools.wraps(original)  # keeps the @register dispatch mark
    def update_weights(self):
        metrics = original(self)
        pushes[0] += 1
        tok = self.tokenizer
        gen = None
        if dist.get_rank() == 0:  # the owner of the first rollout group
            from helpers.tiny_models import left_pad

            ids, mask = left_pad([tok.encode(p) for p in PROMPTS], tok.pad_token_id)
            greedy = SamplingParams(do_sample=False, n=1, response_length=self.train_sampling.response_length,
                                    eos_token_id=(tok.eos_token_id,))
            engine = self.rollout_side.engine.engine  # the SGLang group's engine, owned by this rank
            gen = dict(engine.generate(ids, mask, greedy, pad_token_id=tok.pad_token_id).items())
        box = [gen]
        dist.broadcast_object_list(box, src=0)
        tokens, mismatches, diff = megatron_greedy_check(self, box[0])
        if dist.get_rank() == 0:
            with open(out_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"push": pushes[0], "tokens": tokens, "mismatches": mismatches,
                                     "max_logprob_diff": diff}) + "\n")
        return metrics

    ActorRolloutRefWorker.update_weights = update_weights


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers.tiny_models
    install_check(os.environ["VERL_PARITY_OUT"])
    from verl.trainer import main_ppo

    sys.exit(main_ppo.main(sys.argv[1:]))
