"""A running SGLang engine follows the actor after a training step: the hybrid engine's reshard output,
pushed with SGLangRollout.update_weights (no engine restart), makes SGLang's greedy ids equal the
Megatron engine's greedy on the new weights.

Megatron part (.venv, 2 spawned gloo ranks, tests/distributed/train_step_reshard.py): a tiny Qwen2
actor at training TP2 takes one optimizer step; the project's executor reshards it (all-gather in
the micro-DP group) into the rollout TP1 flat buffer. SGLang part (.venv-sglang, sglang_session.py):
an engine started on the initial checkpoint generates, receives that buffer, generates again.

Rollout TP1 only, to stay within the tier's time budget: a TP2 case adds ~45 s here (SGLang TP2
engine start ~35 s, a second Megatron case ~8 s). TP2 pushes into SGLang are covered by
test_sglang_rollout.py, and the reshard's TP2 buffers by tests/distributed/test_rollout_after_train_step.py.
"""

import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "distributed"))

from tiny_models import save_tiny_model  # noqa: E402
from train_step_reshard import NEW_TOKENS, PROMPTS, train_step_job  # noqa: E402

from verl.launcher.spawn import run_ranks  # noqa: E402

ROLLOUT_TPS = (1,)
PUSH_BUCKET_BYTES = 32 << 10  # several update_weights_from_tensor calls per push


@pytest.fixture(scope="module")
def outcome(run_sglang_session, tmp_path_factory):
    work = tmp_path_factory.mktemp("sglang-after-train-step")
    hf_dir = save_tiny_model("qwen2", str(work / "qwen2"), seed=3)
    cases = {f"rollout tp{t}": (hf_dir, 2, 1, t) for t in ROLLOUT_TPS}
    ranks = run_ranks(train_step_job, 2, cases, timeout_s=240)
    spec = {}
    for name, (_, _, _, rollout_tp) in cases.items():
        by_rollout_rank = {}
        for results in ranks:
            r = results[name]
            by_rollout_rank.setdefault(r["rollout_tp_rank"], r["rollout_buffer"])
        buffers = [by_rollout_rank[j] for j in range(rollout_tp)]
        path = work / f"{name.replace(' ', '_')}.pt"
        torch.save(buffers, path)
        spec[name] = {"model_dir": hf_dir, "tp": rollout_tp, "prompts": PROMPTS, "new_tokens": NEW_TOKENS,
                      "push_buffers": str(path), "bucket_bytes": PUSH_BUCKET_BYTES, "max_total_tokens": 1024}
    return ranks, run_sglang_session(spec, work, timeout_s=300)


@pytest.mark.parametrize("rollout_tp", ROLLOUT_TPS)
def test_sglang_greedy_equals_megatron_greedy_after_train_step_and_push(outcome, rollout_tp):
    ranks, sglang = outcome
    name = f"rollout tp{rollout_tp}"
    megatron = ranks[0][name]
    assert megatron["megatron_after"] != megatron["megatron_before"], "the step changed no greedy choice"
    assert sglang[name]["before"]["ids"] == megatron["megatron_before"]
    assert sglang[name]["buckets"] > 1
    assert sglang[name]["after"]["ids"] == megatron["megatron_after"]
