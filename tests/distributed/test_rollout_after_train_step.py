"""After an optimizer step changes the actor, the hybrid engine's reshard makes the native rollout
engine (created once, before the step) generate exactly the Megatron engine's greedy ids.

2 gloo ranks, fp32. Training layouts: Qwen2 (tied embeddings, qkv bias) at TP2, and Llama (untied,
padded vocab) at TP1 x DP2; rollout TP 1 and 2 for each (TP1 x DP2 -> rollout TP2 has no
zero-redundancy grouping: the all-to-all path); Gemma 3's block (tests/helpers/tiny_models.py BLOCK_MODELS: sliding
window 3, shorter than the prompts, per-layer RoPE, sandwich norms) at TP2 and PP2. The Megatron engine's
cache-free greedy (verl.engine.megatron.generate) is the oracle; the step must change at least one greedy choice.
"""

import pytest

pytest.importorskip("megatron.core")

from helpers.tiny_models import save_tiny_model  # noqa: E402
from train_step_reshard import train_step_job  # noqa: E402

from verl.launcher.spawn import run_ranks  # noqa: E402

CASES = {  # name -> (model, training tp, training pp, rollout tp)
    "qwen2 tp2 -> rollout tp1": ("qwen2", 2, 1, 1),
    "qwen2 tp2 -> rollout tp2": ("qwen2", 2, 1, 2),
    "llama tp1xdp2 -> rollout tp1": ("llama", 1, 1, 1),
    "llama tp1xdp2 -> rollout tp2": ("llama", 1, 1, 2),
    "gemma3 tp2 -> rollout tp1": ("gemma3", 2, 1, 1),
    "gemma3 pp2 -> rollout tp2": ("gemma3", 1, 2, 2),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("after_train_step")
    hf_dirs = {kind: save_tiny_model(kind, str(root / kind), seed=3) for kind in ("qwen2", "llama", "gemma3")}
    cases = {name: (hf_dirs[kind], tp, pp, rollout_tp) for name, (kind, tp, pp, rollout_tp) in CASES.items()}
    return run_ranks(train_step_job, 2, cases, timeout_s=300)


@pytest.mark.parametrize("case", list(CASES))
def test_native_greedy_equals_megatron_greedy_after_a_train_step_and_reshard(ranks, case):
    for rank, results in enumerate(ranks):
        r = results[case]
        assert r["update_successful"], f"rank {rank}: the optimizer step did not run"
        assert r["same_rollout_buffer"], f"rank {rank}: the reshard did not write the engine's own buffer"
        assert r["native_before"] == r["megatron_before"], f"rank {rank}: initial reshard"
        assert r["megatron_after"] != r["megatron_before"], f"rank {rank}: the step changed no greedy choice"
        assert r["native_after"] == r["megatron_after"], f"rank {rank}: reshard after the step"


def test_both_ranks_and_layouts_agree_on_the_new_weights(ranks):
    """Replicas (DP or rollout TP peers) see the same weights; TP2 and TP1xDP2 rollouts of a model agree."""
    for case in CASES:
        assert ranks[0][case]["megatron_after"] == ranks[1][case]["megatron_after"], case
    for kind in ("qwen2", "llama", "gemma3"):
        afters = {tuple(map(tuple, ranks[0][c]["native_after"])) for c in CASES if c.startswith(kind)}
        assert len(afters) == 1, kind
