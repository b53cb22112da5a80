"""verl's agent loops on the SGLang rollout (issue 46 item 4): a multi-turn tool trajectory through SGLang's token
server (.venv-sglang, real SGLang 0.5.23 on CPU) equals the same trajectory through the native engine's, for
greedy decoding on a tiny chat checkpoint: token ids, mask and log-probs, turn by turn; and SGLang's radix cache
served each later turn's prefix (the earlier turns' tokens) from its cache. Then, on the same engine, the batch
with a weight sync while every trajectory's second turn runs: the turns are aborted, new weights pushed, the turns
resume, and every sampled token carries the log-prob of the weights that sampled it (old before, new after). And
the same through the asynchronous trainers' agent stream (verl.workers.agent_stream), whose phases run SGLang's
loop on a thread of their own: each finished trajectory reports the versions that sampled its tokens."""

import json
import os
import subprocess

import torch
from helpers.agent_loop_case import ASSISTANT_TURNS, base_params, model_turn_starts, run_batch, token_sources
from helpers.chat_models import save_chat_model

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "agent_loop_driver.py")
LOGPROB_ATOL = 1e-4


def test_sglang_agent_loop_equals_native_greedy(sglang_python, tmp_path):
    from transformers import AutoTokenizer

    from verl.engine.rollout.native.engine import NativeRollout
    from verl.models.config import ModelConfig

    model_dir = save_chat_model(str(tmp_path / "chat"), seed=3)
    new_model_dir = save_chat_model(str(tmp_path / "chat_new"), seed=4)
    out = tmp_path / "sglang.json"
    # The SGLang side runs while this process runs the native side.
    proc = subprocess.Popen([sglang_python, DRIVER, model_dir, new_model_dir, str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            cwd=str(tmp_path))
    engine = NativeRollout(ModelConfig.from_pretrained(model_dir), pad_token_id=0)
    engine.load_hf_checkpoint(model_dir)
    native = run_batch(engine.token_server(base_params(), pad_token_id=0), AutoTokenizer.from_pretrained(model_dir))
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"SGLang agent-loop driver failed (exit {proc.returncode}):\n{stderr[-6000:]}"
    result = json.loads(out.read_text())
    sglang, partial = result["greedy"], result["partial"]

    assert len(sglang["trajectories"]) == len(native["trajectories"]) == 3
    for got, want in zip(sglang["trajectories"], native["trajectories"], strict=True):
        # Every trajectory ran its 3 model turns with the tool's answers between them.
        assert want["num_turns"] == 2 * ASSISTANT_TURNS
        assert got["prompt_ids"] == want["prompt_ids"]
        assert got["response_ids"] == want["response_ids"]
        assert got["response_mask"] == want["response_mask"]
        assert sum(want["response_mask"]) > ASSISTANT_TURNS  # several tokens a turn
        assert 0 in want["response_mask"]  # tool tokens between the turns
        diff = max(abs(a - b) for a, b in zip(got["response_logprobs"], want["response_logprobs"], strict=True))
        assert diff <= LOGPROB_ATOL, diff
    # Each later turn found the trajectory's previous turn (its prompt, at least) in SGLang's radix cache.
    assert sglang["requests"] == native["requests"] == 3 * ASSISTANT_TURNS
    earlier_turn_prompts = 0
    for t in sglang["trajectories"]:
        mask = t["response_mask"]
        starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]  # each model turn's start
        assert len(starts) == ASSISTANT_TURNS
        earlier_turn_prompts += sum(len(t["prompt_ids"]) + i for i in starts[:-1])
    assert sglang["cached_tokens"] >= earlier_turn_prompts, (sglang["cached_tokens"], earlier_turn_prompts)

    # The weight sync: 3 second turns were running and were cut; each trajectory is old-weights tokens up to a
    # point inside its second turn and new-weights tokens after it, each with that weight's log-prob.
    from transformers import AutoModelForCausalLM

    # The driver aborts once SGLang registered all three second turns; a turn that still ends between that and
    # the abort (a loaded machine) is not cut: its trajectory switches weights at its next turn instead.
    assert partial["running_at_sync"] == 3 and 1 <= partial["interrupted"] <= 3, partial
    hf_old, hf_new = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
                      for p in (model_dir, new_model_dir))
    cut_inside = 0
    for t in partial["trajectories"]:
        sources = token_sources(t, hf_old, hf_new)
        kinds = [kind for _, kind in sources]
        switch = sources[kinds.index("new")][0]
        assert set(kinds[kinds.index("new"):]) == {"new"}
        starts = model_turn_starts(t["response_mask"])
        if starts[1] <= switch and (len(starts) == 2 or switch < starts[2]):
            cut_inside += 1  # cut mid-turn: old-weight tokens, then the rest of the turn on the new weights
        else:
            assert len(starts) > 2 and switch == starts[2], (switch, starts)
    assert cut_inside == partial["interrupted"]

    # The agent stream: a phase on version 0 ended while every second turn ran, the weights changed, the next
    # phase (version 1) ran the trajectories to their end; versions are reported per turn segment.
    stream = result["stream"]
    assert stream["paused"]["agent_loop/in_flight"] == 3 and 1 <= stream["paused"]["agent_loop/interrupted_turns"]
    assert sorted(r["uid"] for r in stream["records"]) == ["g0", "g1", "g2"]
    for t in stream["records"]:
        assert t["error"] is None and t["num_turns"] == 2 * ASSISTANT_TURNS
        assert t["versions"][0] == 0 and t["versions"][-1] == 1 and t["versions"] == sorted(t["versions"])
        kinds = [kind for _, kind in token_sources(t, hf_old, hf_new)]
        switch = kinds.index("new")
        assert set(kinds[:switch]) == {"old"} and set(kinds[switch:]) == {"new"}
