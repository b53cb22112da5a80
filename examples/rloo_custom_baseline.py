"""RLOO (Ahmadian et al. 2024) with the Python API alone: the PPO trainer stepped by hand, its advantage
replaced by the leave-one-out baseline A_i = r_i - 1/(k-1) * sum_{j != i} r_j over the k responses to a prompt.
Run: python examples/rloo_custom_baseline.py CONFIG.yaml STEPS (verl's keys; rollout.n >= 2)."""
import json
import sys

import numpy as np
import torch

from verl.trainer.ppo import PPOTrainer


def leave_one_out(scores, groups):
    """Each score minus the mean of the other scores of its group (a group of one keeps its score)."""
    ids = torch.as_tensor(np.unique(np.asarray(groups), return_inverse=True)[1])
    same = (ids[:, None] == ids[None, :]).float()
    k = same.sum(-1)
    others = (same @ scores - scores) / (k - 1).clamp(min=1)
    return torch.where(k > 1, scores - others, scores)


def main(config, steps):
    trainer = PPOTrainer(config)
    for _ in range(steps):
        data = trainer.rollout()
        scores = data.batch["token_level_rewards"].sum(-1)
        advantage = leave_one_out(scores, data.non_tensor_batch["uid"])
        data.batch["advantages"] = advantage[:, None] * data.batch["response_mask"]
        metrics = trainer.update(data)
        if trainer.rank == 0:
            print(json.dumps({"step": trainer.global_step, "score": scores.mean().item(),
                              "loss": metrics["loss"]}), flush=True)
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
