"""`verl generate` and ``python -m verl.trainer.main_generation``: which of the three command lines this is.

- verl's Hydra keys (``data.path=... model.path=... rollout.*``): verl's generation job,
  :mod:`verl.trainer.generation_job`;
- ``--prompt TEXT [--prompt TEXT ...] [--chat]``: text in, text out. The texts are tokenised with the checkpoint's
  tokenizer (``--chat``: each is one user message through its chat template with the generation prompt), run as
  ``--input-ids`` by the token-id command (so every engine and ``--tp`` takes them), and the responses are
  decoded (special tokens dropped): printed, or added to ``--json``'s output as ``"text"`` (one per sample);
- anything else: the token-id command, :func:`verl.trainer.main_generation.main`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence

from verl.errors import EXIT_INPUT_ERROR, InputError


def _has_option(argv: Sequence[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in argv)


def _without(argv: Sequence[str], options: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``argv`` without ``options`` (``--o V`` / ``--o=V``) and ``flags``."""
    from verl.launcher.spawn import without_option

    return [a for a in without_option(list(argv), *options) if a not in flags]


def prompt_ids(model: str, texts: Sequence[str], chat: bool) -> tuple[list[list[int]], object]:
    """The token ids of each text (``chat``: as a user message through the chat template) and the tokenizer."""
    from verl.trainer.generation_job import load_tokenizer, render
    from verl.utils.dataset.rl_dataset import encode_prompt

    tokenizer = load_tokenizer(model, "--model")
    out = []
    for i, text in enumerate(texts):
        where = f"--prompt #{i}"
        prompt = render([{"role": "user", "content": text}] if chat else text, tokenizer, where)
        ids = encode_prompt(prompt, tokenizer, templated=chat)
        if not ids:
            raise InputError(f"{where}: expected a prompt of at least one token, found an empty one")
        out.append(ids)
    return out, tokenizer


def _print_texts(texts: list[str], n: int) -> None:
    if len(texts) == 1:
        print(texts[0])
        return
    for i, text in enumerate(texts):
        print(f"--- prompt {i // n} sample {i % n} ---")
        print(text)


def text_main(argv: list[str]) -> int:
    """``--prompt`` texts through the token-id command; decoded responses printed or written."""
    from verl.trainer.main_generation import build_parser
    from verl.trainer.main_generation import main as ids_main

    try:
        args = build_parser().parse_args(argv)
        if args.input_ids:
            raise InputError("--prompt: expected either --prompt texts or --input-ids, found both")
        if args.n < 1:
            raise InputError(f"--n: expected a positive integer, found {args.n}")
        ids, tokenizer = prompt_ids(args.model, args.prompt, args.chat)
    except InputError as exc:
        print(f"verl generate: error: {exc}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    rest = _without(argv, ("--prompt", "--json"), ("--chat",))
    with tempfile.TemporaryDirectory(prefix="verl-generate-text-") as tmp:
        output = os.path.join(tmp, "output.json")
        code = ids_main([*rest, *(f"--input-ids={','.join(map(str, p))}" for p in ids), "--json", output])
        if code != 0:
            return code
        with open(output, encoding="utf-8") as fh:
            result = json.load(fh)
    result["text"] = [tokenizer.decode(row, skip_special_tokens=True) for row in result["output_ids"]]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh)
    else:
        _print_texts(result["text"], args.n)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from verl.trainer.generation_job import is_job_argv

    if is_job_argv(argv):
        from verl.trainer.generation_job import main as job_main

        return job_main(argv)
    if _has_option(argv, "--prompt"):
        return text_main(argv)
    if _has_option(argv, "--chat"):
        print("verl generate: error: --chat: expected --prompt TEXT to apply the chat template to, found none",
              file=sys.stderr)
        return EXIT_INPUT_ERROR
    from verl.trainer.main_generation import main as ids_main

    return ids_main(argv)


if __name__ == "__main__":
    sys.exit(main())
