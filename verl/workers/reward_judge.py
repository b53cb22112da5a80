"""Generative reward models (LLM judges): verl 0.9's ``reward.reward_model`` with a causal LM, served by a rollout
engine from the rollout registry on every trainer rank, asleep while the trainer trains.

A judge is on when ``reward.reward_model.judge.prompt_template`` is set (and the reward model is enabled); then
``reward.reward_model.model_path`` (= ``reward_model.model.path``) is an HF causal LM with its own tokenizer.
For each row of its share of the step's batch a rank:

1. renders the template: ``{question}`` = the dataset's prompt (the last user message of ``raw_prompt``, else the
   actor's prompt decoded), ``{response}`` = the actor's response decoded with the actor's tokenizer,
   ``{reference}`` = ``reward_model.ground_truth``; the judge's chat template (if its tokenizer has one) wraps it
   as one user message with the generation prompt; a prompt longer than ``rollout.prompt_length`` loses tokens
   from the middle of its ``{response}`` (then of its ``{question}``), never from the template's instructions or
   the reference (``reward_model/judge_truncated_frac``; instructions and reference that alone do not fit are one
   error line);
2. generates the verdicts on the judge's engine (``reward.reward_model.rollout``: sampling, ``response_length``),
   all rows in one call that stops at ``judge.timeout_s`` whatever is still generating;
3. parses each verdict into a score with ``judge.parse_function`` (a user's ``fn(verdict, *, question, response,
   reference, data_source, extra_info)`` returning a number, or None when it finds no verdict; default:
   :func:`parse_verdict`). A row whose verdict was cut by the timeout, or whose parse returned None or a
   non-finite number, scores ``judge.default_score``; ``reward_model/judge_default_frac`` counts them. A parsed
   score is clamped to the declared ``[judge.score_min, judge.score_max]`` (``reward_model/judge_clamped_frac``).

The score goes on the last valid response token, as a classifier RM's does (the reward-model worker places it).
With ``rollout.free_cache_engine`` the engine releases its weights and KV cache after judging and takes them back
before the next call (from a host copy on an accelerator, from the checkpoint on CPU, where the weights' memory is
the host's): the judge holds no memory while the actor, critic and reference train.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import string
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from verl.errors import InputError
from verl.utils.config_checks import ConfigError

TEMPLATE_FIELDS = ("question", "response", "reference")
TEMPLATE_KEY = "reward.reward_model.judge.prompt_template"
PARSE_KEY = "reward.reward_model.judge.parse_function"
if TYPE_CHECKING:
    import torch

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


class JudgeParseError(RuntimeError):
    """A parse function that returned something other than a number or None (a bug in the user's function)."""


def template_fields(template: Any, key: str = TEMPLATE_KEY) -> frozenset[str]:
    """The placeholders of a judge template; one ConfigError line unless it is text naming ``{response}`` and
    only fields of :data:`TEMPLATE_FIELDS` (literal braces are written ``{{`` and ``}}``)."""
    if not isinstance(template, str) or not template.strip():
        raise ConfigError(f"{key}: expected the judge's prompt text with a {{response}} placeholder, found "
                          f"{template!r}")
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as err:
        raise ConfigError(f"{key}: expected a template with {{question}}, {{response}}, {{reference}} placeholders "
                          f"(literal braces doubled), found one that does not parse: {err}") from None
    unknown = sorted({f for f in fields if f not in TEMPLATE_FIELDS})
    if unknown:
        raise ConfigError(f"{key}: expected placeholders among {{question}}, {{response}}, {{reference}}, found "
                          + ", ".join("{" + f + "}" for f in unknown))
    if "response" not in fields:
        raise ConfigError(f"{key}: expected a {{response}} placeholder (the judge must see the response it "
                          f"scores), found " + (", ".join("{" + f + "}" for f in dict.fromkeys(fields)) or "none"))
    return frozenset(fields)


def parse_verdict(verdict: str, **_: Any) -> float | None:
    """The default parse: the last number in the verdict (``"Score: 7/10"`` -> 10.0 is a template's job to avoid:
    ask for the score alone or last), None when it has none."""
    found = _NUMBER.findall(verdict)
    return float(found[-1]) if found else None


def load_parse_function(path: str | None, name: str) -> Callable[..., Any]:
    """``judge.parse_function``: function ``name`` in the file at ``path`` (executed: trust it), or
    :func:`parse_verdict` when ``path`` is null."""
    if path is None:
        return parse_verdict
    from verl.utils.reward_score.loader import RewardFunctionError, load_reward_fn

    if not path.endswith(".py") and not os.path.isfile(path):
        raise ConfigError(f"{PARSE_KEY}.path: expected a .py file, found {path!r}")
    try:
        return load_reward_fn(path, name)
    except RewardFunctionError as err:
        raise ConfigError(f"{PARSE_KEY}: {str(err).removeprefix('reward function: ')}") from None


def _is_causal_lm(config: Mapping[str, Any]) -> bool:
    return any(str(a).endswith("ForCausalLM") for a in config.get("architectures") or [])


def check_judge(cfg: dict[str, Any], actor_tokenizer: str | None) -> None:
    """The config check of a judge (a composed plain config with paths resolved), before any rank starts: the
    template, the parse function, the checkpoint (a causal LM the judge's engine runs, with a tokenizer), the
    engine's layout and token budgets. Fills ``reward_model.model.input_tokenizer`` with the actor's tokenizer."""
    from verl.engine.rollout.registry import rollout_engine
    from verl.models.config import ModelConfig, ModelConfigError
    from verl.workers.reward_model.plan import has_tokenizer, load_tokenizer

    section = cfg["reward"]["reward_model"]
    judge, rollout = section["judge"], section["rollout"]
    template_fields(judge["prompt_template"])
    load_parse_function(judge["parse_function"]["path"], judge["parse_function"]["name"])
    key, path = "reward_model.model.path", cfg["reward_model"]["model"]["path"]
    if path is None or not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{key}: expected the judge's HF causal LM directory (config.json, weights, tokenizer) "
                          f"with {TEMPLATE_KEY} set, found {'null' if path is None else 'no config.json in ' + path}")
    with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
        hf_config = json.load(fh)
    if not _is_causal_lm(hf_config):
        found = (hf_config.get("architectures") or ["no architecture"])[0]
        raise ConfigError(f"{key}: expected a generative judge (*ForCausalLM) with {TEMPLATE_KEY} set, found "
                          f"{found} in {path}")
    if not has_tokenizer(path):
        raise ConfigError(f"{key}: expected the judge's tokenizer (tokenizer.json or tokenizer_config.json) in "
                          f"{path}, found none")
    load_tokenizer(path, key)
    name_key = "reward.reward_model.rollout.name"
    engine = rollout_engine(rollout["name"], name_key)
    # The judge runs in each trainer rank's own Python and stops its call at the deadline (a segment stop).
    caps = engine.capabilities
    if caps.python_env is not None or not caps.partial_rollout:
        why = f"runs only in {caps.python_env}'s Python" if caps.python_env else "cannot stop a call at a deadline"
        raise ConfigError(f"{name_key}: expected an engine that runs in the trainer's process and stops at "
                          f"judge.timeout_s (native), found {rollout['name']!r}, which {why}")
    if rollout["tensor_model_parallel_size"] != 1:
        raise ConfigError("reward.reward_model.rollout.tensor_model_parallel_size: expected 1 (every rank runs a "
                          f"whole judge on its share of the batch), found {rollout['tensor_model_parallel_size']}")
    try:
        model = ModelConfig.from_pretrained(path)
    except ModelConfigError as err:
        raise ConfigError(f"{key}: {err}") from None
    if engine.check_model is not None:
        engine.check_model(model, 1)
    longest = rollout["prompt_length"] + rollout["response_length"]
    if longest > model.max_position_embeddings:
        raise ConfigError(f"reward.reward_model.rollout.prompt_length + response_length: expected <= the judge's "
                          f"max_position_embeddings={model.max_position_embeddings}, found {longest}")
    rm = cfg["reward_model"]
    if rm["model"]["input_tokenizer"] is None:
        if actor_tokenizer is None:
            raise ConfigError("reward_model.model.input_tokenizer: expected the actor's tokenizer (data.tokenizer or "
                              "this key) to decode the responses a judge reads, found null")
        rm["model"]["input_tokenizer"] = actor_tokenizer
    if rm["hot_swap"]["path"] is not None:
        raise ConfigError("reward_model.hot_swap.path: expected null with a judge (a hot swap replaces classifier "
                          f"reward models), found {rm['hot_swap']['path']!r}")


def _eos_ids(tokenizer: Any, model_dir: str) -> tuple[int, ...]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen):
        with open(gen, encoding="utf-8") as fh:
            eos = json.load(fh).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    return tuple(sorted(ids))


def _question(raw_prompt: Any, decoded: str) -> str:
    if isinstance(raw_prompt, str):
        return raw_prompt
    if raw_prompt is not None:
        users = [m.get("content") for m in list(raw_prompt) if isinstance(m, Mapping) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    return decoded


class Judge:
    """One rank's judge: its tokenizer, its engine (built by the rollout registry) and the parse function.
    ``section``: ``reward.reward_model`` (:class:`~verl.workers.config.reward.RewardModelKeysConfig`)."""

    def __init__(self, model_path: str, section: Any, actor_tokenizer: Any, seed: int, rank: int = 0):

        from verl.engine.rollout.base import SamplingParams
        from verl.engine.rollout.registry import StandaloneSite, rollout_engine
        from verl.models.config import ModelConfig
        from verl.utils.device import get_device
        from verl.workers.reward_model.plan import load_tokenizer

        self.path, self.section, self.rank = model_path, section, rank
        judge, rollout = section.judge, section.rollout
        self.fields = template_fields(judge.prompt_template)
        self.template = judge.prompt_template
        self.parse = load_parse_function(judge.parse_function.path, judge.parse_function.name)
        self.default_score = float(judge.default_score)
        self.score_min, self.score_max = float(judge.score_min), float(judge.score_max)
        self.timeout_s = float(judge.timeout_s)
        self.actor_tokenizer = actor_tokenizer
        self.tokenizer = load_tokenizer(model_path, "reward_model.model.path")
        self.model_config = ModelConfig.from_pretrained(model_path)
        pad = self.tokenizer.pad_token_id
        eos = _eos_ids(self.tokenizer, model_path)
        self.pad_id = int(pad if pad is not None else (eos[0] if eos else 0))
        self.sampling = SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                                       response_length=rollout.response_length, n=1, do_sample=rollout.do_sample,
                                       eos_token_id=eos)
        self.seed, self.calls = seed + rollout.seed, 0
        self.free_cache_engine = rollout.free_cache_engine
        site = StandaloneSite(self.model_config, model_path, tp_size=1, tp_group=None, dtype=rollout.dtype,
                              pad_token_id=self.pad_id, seed=self.seed, max_rows=1,
                              max_seq_len=rollout.prompt_length + rollout.response_length)
        self._stack = contextlib.ExitStack()
        self.engine = self._stack.enter_context(
            rollout_engine(rollout.name, "reward.reward_model.rollout.name").open_standalone(site))
        self.weight_bytes = self.engine.weight_buffer().numel() * self.engine.weight_buffer().element_size()
        # A host copy to wake from on an accelerator; on CPU the checkpoint is read again (no second copy).
        self._host = None
        if self.free_cache_engine and get_device().type != "cpu":
            self._host = self.engine.weight_buffer().detach().to("cpu", copy=True).pin_memory()
        self.awake = True
        if self.free_cache_engine:
            self.sleep()

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        if self.awake:
            self.engine.release()
            self.awake = False

    def wake(self) -> None:
        if self.awake:
            return
        self.engine.resume()
        if self._host is not None:
            self.engine.weight_buffer().copy_(self._host, non_blocking=True)
        else:
            self.engine.load_hf_checkpoint(self.path)
        self.awake = True

    def resident_bytes(self) -> int:
        """Bytes the engine holds now: its weights and KV cache (0 asleep)."""
        if not self.awake:
            return 0
        return sum(t.numel() * t.element_size() for t in self.engine.resident_tensors())

    def close(self) -> None:
        self._stack.close()

    # ------------------------------------------------------------------ prompts
    def _texts(self, fields: Mapping[str, torch.Tensor], response_length: int) -> list[tuple[str, str]]:
        from verl.workers.reward_model.retokenize import decode_rows

        return decode_rows(self.actor_tokenizer, fields["input_ids"], fields["attention_mask"], response_length)

    def render(self, question: str, response: str, reference: Any) -> list[int]:
        """The judge's prompt tokens for one row (before truncation)."""
        values = {"question": question, "response": response, "reference": "" if reference is None else
                  str(reference)}
        text = self.template.format(**{k: values[k] for k in self.fields})
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(text)["input_ids"])

    def fit(self, question: str, response: str, reference: Any, limit: int) -> tuple[list[int], bool]:
        """The judge's prompt tokens for one row within ``limit`` tokens, and whether they were cut: the
        response's middle goes first, then the question's; the template's own text and the reference are kept
        whole (an InputError line when they alone exceed ``limit``)."""
        ids = self.render(question, response, reference)
        if len(ids) <= limit:
            return ids, False
        for field in ("response", "question"):
            if field not in self.fields:
                continue
            text = response if field == "response" else question
            parts = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            keep = len(parts)
            while len(ids) > limit and keep > 0:
                keep = max(0, keep - max(1, len(ids) - limit))
                cut = _cut_middle(self.tokenizer, parts, keep)
                if field == "response":
                    response = cut
                else:
                    question = cut
                ids = self.render(question, response, reference)
            if len(ids) <= limit:
                return ids, True
        raise InputError(f"reward.reward_model.rollout.prompt_length: expected room for the judge template's "
                         f"instructions and reference ({len(ids)} tokens with an empty response and question), "
                         f"found prompt_length={limit}")

    def prompts(self, fields: Mapping[str, torch.Tensor], non_tensor: Mapping[str, Sequence[Any]],
                response_length: int) -> tuple[list[dict[str, Any]], list[list[int]], list[bool]]:
        """Each row's context (question, response, reference, data_source, extra_info), its judge prompt tokens
        within ``rollout.prompt_length`` (:meth:`fit`), and whether they were cut."""
        rows = len(fields["input_ids"])

        def column(name: str) -> Sequence[Any]:
            value = non_tensor.get(name) if non_tensor else None
            return value if value is not None else [None] * rows

        raw, rm_info, sources, extra = (column("raw_prompt"), column("reward_model"), column("data_source"),
                                        column("extra_info"))
        contexts, tokens, cut = [], [], []
        limit = self.section.rollout.prompt_length
        for i, (prompt, response) in enumerate(self._texts(fields, response_length)):
            reference = rm_info[i].get("ground_truth") if isinstance(rm_info[i], Mapping) else None
            if "reference" in self.fields and reference is None:
                raise InputError(f"{TEMPLATE_KEY}: names {{reference}}, so expected reward_model.ground_truth in "
                                 f"every row, found none in row {i} (data_source={sources[i]!r})")
            context = {"question": _question(raw[i], prompt), "response": response, "reference": reference,
                       "data_source": sources[i], "extra_info": extra[i]}
            ids, was_cut = self.fit(context["question"], response, reference, limit)
            cut.append(was_cut)
            contexts.append(context)
            tokens.append(ids)
        return contexts, tokens, cut

    # ------------------------------------------------------------------ judging
    def _generate(self, tokens: list[list[int]]) -> tuple[list[list[int]], list[bool]]:
        """Verdict tokens per row and whether the row finished (a stop token, or its whole budget) before the
        deadline."""
        import torch

        from verl.engine.rollout.partial import SegmentStop

        rows = len(tokens)
        width = max(len(t) for t in tokens)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for i, row in enumerate(tokens):
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
        deadline = time.monotonic() + self.timeout_s
        stop = SegmentStop(group=torch.arange(rows), min_groups=rows, abort=lambda: time.monotonic() > deadline)
        params = self.sampling
        if not params.greedy:  # each call and rank its own stream, reproducible from the seed
            import dataclasses

            params = dataclasses.replace(params, seed=(self.seed * 1_000_003 + self.calls * 1009 + self.rank)
                                         % 2 ** 62)
        responses, response_mask, _ = self.engine.generate_responses(ids, mask, params, self.pad_id, stop=stop)
        stops = set(params.stop_ids)
        verdicts, finished = [], []
        for row, row_mask in zip(responses.tolist(), response_mask.tolist(), strict=True):
            length = int(sum(row_mask))
            verdict = row[:length]
            verdicts.append(verdict)
            finished.append(length >= params.response_length or (length > 0 and verdict[-1] in stops))
        return verdicts, finished

    def score(self, fields: Mapping[str, torch.Tensor], non_tensor: Mapping[str, Sequence[Any]] | None,
              response_length: int) -> tuple[torch.Tensor, dict[str, float], list[str]]:
        """(scores [B] float32, metrics, verdict texts) of this rank's rows."""
        import torch

        rows = len(fields["input_ids"])
        if rows == 0:
            return torch.zeros(0), {}, []
        contexts, tokens, cut = self.prompts(fields, non_tensor or {}, response_length)
        start = time.monotonic()
        self.wake()
        woke = time.monotonic()
        try:
            verdict_ids, finished = self._generate(tokens)
        finally:
            self.calls += 1
            if self.free_cache_engine:
                self.sleep()
        generated = time.monotonic()
        scores, timed_out, unparsed, clamped, texts = [], 0, 0, 0, []
        for i, (ids, done, context) in enumerate(zip(verdict_ids, finished, contexts, strict=True)):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            texts.append(text)
            if not done:
                timed_out += 1
                scores.append(self.default_score)
                continue
            value = self.parse(text, **context)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise JudgeParseError(f"{PARSE_KEY}: expected a number or None from the parse function, found "
                                      f"{type(value).__name__} {value!r} for row {i} "
                                      f"(data_source={context['data_source']!r})")
            if value is None or not math.isfinite(float(value)):
                unparsed += 1
                scores.append(self.default_score)
            else:
                value = float(value)
                bounded = min(max(value, self.score_min), self.score_max)
                clamped += bounded != value
                scores.append(bounded)
        metrics = {"reward_model/judge_default_frac": (timed_out + unparsed) / rows,
                   "reward_model/judge_clamped_frac": clamped / rows,
                   "reward_model/judge_timeout_frac": timed_out / rows,
                   "reward_model/judge_unparsed_frac": unparsed / rows,
                   "reward_model/judge_truncated_frac": sum(cut) / rows,
                   "reward_model/judge_verdict_length": sum(len(v) for v in verdict_ids) / rows,
                   "reward_model/judge_wake_s": woke - start,
                   "reward_model/judge_generate_s": generated - woke}
        return torch.tensor(scores, dtype=torch.float32), metrics, texts


TRUNCATION_MARK = " ...(truncated)... "


def _cut_middle(tokenizer: Any, ids: list[int], keep: int) -> str:
    """The text of ``ids`` with only ``keep`` tokens left, half from each end, a mark where the middle was."""
    if keep >= len(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)
    head = keep - keep // 2
    tail = ids[len(ids) - keep // 2:] if keep // 2 else []
    return (tokenizer.decode(ids[:head], skip_special_tokens=True) + TRUNCATION_MARK
            + tokenizer.decode(tail, skip_special_tokens=True))
