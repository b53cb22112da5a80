"""What a reward-model checkpoint is and how its inputs are made, decided from its directory alone (config.json
and tokenizer files), the same way by the config check (before any rank starts) and by the worker.

``engine``:
  ``training``    a decoder ``*ForSequenceClassification`` of a family the training engines build (Llama, Qwen2,
                  ...; or a bare config.json, today's seeded RM): the role's FSDP or Megatron engine, score head.
  ``replicated``  any other ``*ForSequenceClassification`` (encoders: BERT, DeBERTa-v2/v3, RoBERTa, ...):
                  transformers' own module on every rank, no sharding (they are small).
``retokenize``: the RM reads its own tokens: the actor's prompt + response are decoded and re-encoded with the RM's
tokenizer (its chat template, or for an encoder without one the (prompt, response) text pair). Always for a
replicated RM; for a training-engine RM when ``reward_model.model.input_tokenizer`` (verl's switch) is set and
the RM directory holds a tokenizer. The config check fills ``input_tokenizer`` with the actor's tokenizer when
the RM's own tokenizer has another vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import os

from verl.models.hf_io import has_hf_weights
from verl.utils.config_checks import ConfigError

SCORE_SUFFIX = "ForSequenceClassification"
# Families whose classifier scores a (prompt, response) text pair when its tokenizer has no chat template.
ENCODER_TYPES = frozenset({"bert", "deberta", "deberta-v2", "roberta", "xlm-roberta", "distilbert", "electra",
                           "albert", "modernbert", "camembert"})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclasses.dataclass(frozen=True)
class RewardModelPlan:
    path: str
    model_type: str
    architecture: str | None
    engine: str  # training | replicated
    retokenize: bool
    template: str | None  # chat | pair (retokenize only)
    max_position_embeddings: int | None


def has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)


def _training_types() -> tuple[str, ...]:
    from verl.models.spec.registry import model_types

    return model_types()


def _num_labels(config: dict) -> int:
    if config.get("id2label"):
        return len(config["id2label"])
    return int(config.get("num_labels", 2))  # transformers' default when config.json names neither


def read_reward_model(path: str | None, key: str) -> tuple[str, str | None, str, int | None]:
    """(model_type, architecture, engine, max_position_embeddings) of the checkpoint at ``path``; one ConfigError
    line when it is missing or is not a single-score classifier."""
    if path is None:
        raise ConfigError(f"{key}: expected an HF reward model directory (config.json of a *{SCORE_SUFFIX} with "
                          "num_labels=1), found null")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(f"{key}: expected an HF reward model directory (config.json of a *{SCORE_SUFFIX} with "
                          f"num_labels=1), found no config.json in {path}")
    with open(config_file, encoding="utf-8") as fh:
        config = json.load(fh)
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    architecture = architectures[0] if architectures else None
    if architecture is not None and not architecture.endswith(SCORE_SUFFIX):
        if not has_hf_weights(path) and model_type in _training_types():
            # A bare config.json is a seeded init (score head at zero) whatever it names: today's behaviour.
            architecture = None
        else:  # weights without a score head: every score would silently be zero
            raise ConfigError(f"{key}: expected a single-score classifier (*{SCORE_SUFFIX}, num_labels=1), "
                              f"found {architecture} in {path}")
    if architecture is not None and _num_labels(config) != 1:
        raise ConfigError(f"{key}: expected a single-score classifier (num_labels=1), found {architecture} with "
                          f"num_labels={_num_labels(config)} in {path}")
    if model_type in _training_types():
        engine = "training"
    elif architecture is not None:
        engine = "replicated"
    else:
        raise ConfigError(f"{key}: expected config.json to name its architecture (*{SCORE_SUFFIX}) for a "
                          f"model_type={model_type!r} reward model, found none in {path}")
    limit = config.get("max_position_embeddings")
    return model_type, architecture, engine, int(limit) if isinstance(limit, int) and limit > 0 else None


def load_tokenizer(path: str, key: str):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{key}: expected a tokenizer transformers can load from {path}, found: {first}") from None


def plan_reward_model(path: str | None, input_tokenizer: str | None, key: str = "reward_model.model.path",
                      actor_tokenizer: str | None = None) -> RewardModelPlan:
    """The worker's plan for the RM at ``path``; ``input_tokenizer``: the actor's tokenizer (verl's switch).
    ``actor_tokenizer`` (config check only): with no ``input_tokenizer``, compare the RM's own tokenizer with
    it; a different vocabulary means retokenize (the caller then sets ``input_tokenizer``)."""
    model_type, architecture, engine, limit = read_reward_model(path, key)
    own = has_tokenizer(path)
    if engine == "replicated" and not own:
        raise ConfigError(f"{key}: expected the reward model's own tokenizer (tokenizer.json or "
                          f"tokenizer_config.json) beside its {architecture}, found none in {path}")
    rm_tokenizer = load_tokenizer(path, key) if own else None
    if engine == "replicated":
        retokenize = True
    elif not own:
        retokenize = False  # scores the actor's ids (its vocabulary is checked against the actor's)
    elif input_tokenizer is not None:
        retokenize = True
    elif actor_tokenizer is not None and has_tokenizer(actor_tokenizer):
        actor = load_tokenizer(actor_tokenizer, "data.tokenizer")
        retokenize = actor.get_vocab() != rm_tokenizer.get_vocab()
    else:
        retokenize = False
    template = None
    if retokenize:
        if getattr(rm_tokenizer, "chat_template", None):
            template = "chat"
        elif model_type in ENCODER_TYPES:
            template = "pair"
        else:
            raise ConfigError(f"{key}: expected a chat template in the reward model's tokenizer (a {model_type} "
                              f"reward model with its own tokenizer scores the conversation its template renders), "
                              f"found none in {path}")
    return RewardModelPlan(path, model_type, architecture, engine, retokenize, template, limit)


def check_reward_models(rm: dict, actor_tokenizer: str | None) -> dict[str, RewardModelPlan]:
    """The config check of ``reward_model.model.path`` and ``hot_swap.path`` (the plain dict of the section):
    each plan by dotted key. Fills ``model.input_tokenizer`` with the actor's tokenizer when an RM needs it."""
    if rm["model"]["input_tokenizer"] is not None and not os.path.isdir(rm["model"]["input_tokenizer"]):
        raise ConfigError(f"reward_model.model.input_tokenizer: expected the actor's tokenizer directory, found "
                          f"nothing at {rm['model']['input_tokenizer']}")
    plans = {}
    for key, path in (("model.path", rm["model"]["path"]), ("hot_swap.path", rm["hot_swap"]["path"])):
        if key == "hot_swap.path" and path is None:
            continue
        plans[key] = plan_reward_model(path, rm["model"]["input_tokenizer"], f"reward_model.{key}", actor_tokenizer)
        if rm["model"]["input_tokenizer"] is not None and not has_tokenizer(path) and plans[key].engine == "training":
            raise ConfigError(f"reward_model.model.input_tokenizer: set, so expected the reward model's own tokenizer "
                              f"in reward_model.{key}={path}, found none")
    if rm["model"]["input_tokenizer"] is None and any(p.retokenize for p in plans.values()):
        if actor_tokenizer is None:
            raise ConfigError("reward_model.model.input_tokenizer: expected the actor's tokenizer (data.tokenizer or "
                              "this key) to decode responses for a reward model with its own tokenizer, found null")
        rm["model"]["input_tokenizer"] = actor_tokenizer
    return plans
