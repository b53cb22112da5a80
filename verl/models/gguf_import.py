"""A GGUF checkpoint -> an ordinary HF directory (safetensors, config.json, tokenizer with its chat template,
generation_config.json), so every loader of the project reads it as it reads any HF model.

    python -m verl.models.gguf_import MODEL.gguf OUT_DIR [--dtype float32]

transformers' GGUF reader (needs the ``gguf`` and ``accelerate`` packages) dequantizes the weights, but the model
it returns is flagged quantized and refuses ``save_pretrained``; so the dequantized state dict is loaded into a
model built from the same config without the quantization entry, tied weights are tied again (a tied GGUF has no
``lm_head``), and that model is saved. Everything is written to ``OUT_DIR.tmp-<pid>`` and renamed into place at
the end: an interrupted conversion never leaves an ``OUT_DIR`` that looks finished.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch

from verl.errors import EXIT_INPUT_ERROR, InputError
from verl.utils.torch_dtypes import DTYPES


class GGUFImportError(InputError):
    """A GGUF file that cannot be converted (missing, unreadable, or an architecture transformers cannot build)."""


def convert_gguf_to_hf(gguf_path: str, out_dir: str, dtype: torch.dtype = torch.float32) -> str:
    """Write ``gguf_path`` as an HF directory ``out_dir`` (which must not exist yet); returns ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = os.path.abspath(gguf_path), os.path.abspath(out_dir)
    if not os.path.isfile(gguf_path):
        raise GGUFImportError(f"GGUF import: expected a .gguf file at {gguf_path}, found nothing")
    if os.path.exists(out_dir):
        raise GGUFImportError(f"GGUF import: expected an output path that does not exist yet, found {out_dir}")
    folder, name = os.path.split(gguf_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    except (ValueError, OSError) as err:
        raise GGUFImportError(f"GGUF import: {gguf_path}: {str(err).splitlines()[0] if str(err) else err!r}") from None
    config = quantized.config
    # The plain model must not be built as a quantized one (nor claim to be in its config.json).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = quantized.state_dict()
    generation = quantized.generation_config
    del quantized
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    result = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise GGUFImportError(f"GGUF import: {gguf_path}: expected the dequantized tensors to fill the model, found "
                              f"missing {sorted(set(result.missing_keys) - tied)[:3]}, "
                              f"unexpected {sorted(result.unexpected_keys)[:3]}")
    model.tie_weights()
    # Chat models end a turn with the tokenizer's eos (<|im_end|> for ChatML): generation stops there.
    if tokenizer.eos_token_id is not None and generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id
    if tokenizer.pad_token_id is not None and generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id
    model.generation_config = generation

    staging = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl.models.gguf_import", description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", help="the .gguf file")
    parser.add_argument("out", help="output HF directory (must not exist)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = parser.parse_args(argv)
    try:
        print(convert_gguf_to_hf(args.gguf, args.out, DTYPES[args.dtype]))
    except InputError as err:
        print(f"gguf_import: error: {err}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
