"""Off-policy rollout correction (verl's ``algorithm.rollout_correction``): IS weights, rejection masks, metrics.

The rollout engine samples responses under π_rollout (another numeric precision, or an older checkpoint);
the PPO loss is computed against π_old. With ``log_ratio = old_log_prob - rollout_log_prob`` (log π_old/π_rollout),
every exponent is clamped to ±``SAFETY_BOUND`` (20) first. Shapes: ``B`` rows, ``R`` response tokens.

Importance sampling (``rollout_is``; weights are detached, zero on padding):
- token:    ``w_t = exp(clamp(lr_t, ±20))``
- sequence: ``w_t = exp(clamp(Σ_s mask_s·lr_s, ±20))`` — the product of the token ratios, broadcast to the row
- TIS (``rollout_is_threshold`` a float u):         ``w = min(w, u)`` (no lower clamp)
- IcePop (``rollout_is_threshold`` "lo_hi"):         ``w = w if lo <= w <= hi else 0`` (the mask is unchanged)
- ``rollout_is_batch_normalize``: ``w /= mean(w)`` (token: masked token mean; sequence: mean of per-row weights;
  global over the default process group when torch.distributed is initialised; skipped if mean <= 1e-8)

Rejection sampling (``rollout_rs``, comma-separated options, ANDed), on the clamped lr:
- ``k1 = -lr``, ``k2 = lr²/2``, ``k3 = exp(lr) - 1 - lr``
- ``token_k*``: per token; ``seq_sum_k*`` / ``seq_mean_k*`` / ``seq_max_k*``: masked sum / mean / max over the row,
  the whole row kept or rejected (``seq_mean_k1`` is "geometric" RS: log of the inverse geometric-mean ratio)
- k1 keeps ``log(lower) <= stat <= log(upper)`` (a single x means upper = x, lower = 1/x); k2/k3 keep ``stat <= upper``
- ``response_mask := response_mask * keep``

Where they apply: the final per-token PPO loss (after clip and dual-clip) is multiplied by the weights,
``pg_losses * rollout_is_weights``; the rejection mask replaces ``response_mask``, so rejected tokens leave both the
loss and its normalisation. As in verl, the IS weights and the rejection mask are both computed from the mask as
given (independently); a rejected token keeps its weight but is dropped by the mask.

Every metric key starts with ``rollout_corr/`` and every value is a python float. Averages "over rows" are over
the rows with at least one valid token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from verl.errors import InputError
from verl.utils.torch_functional import masked_mean

SAFETY_BOUND = 20.0
PREFIX = "rollout_corr/"

RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip

_KEY = "algorithm.rollout_correction."
IS_LEVELS = ("token", "sequence")


# --------------------------------------------------------------------------- config parsing
def _to_float(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def parse_is_threshold(value) -> tuple[float | None, float]:
    """``rollout_is_threshold`` -> ``(lower, upper)``: a float u is TIS ``(None, u)``; "lo_hi" is IcePop ``(lo, hi)``.

    A number-like string without ``_`` ("2.0") is a TIS bound, as in verl.
    """
    expected = "a positive float (TIS upper bound) or a 'lower_upper' string with 0 < lower <= upper (IcePop)"
    bad = InputError(f"{_KEY}rollout_is_threshold: expected {expected}, found {value!r}")
    if isinstance(value, bool) or value is None:
        raise bad
    if isinstance(value, (int, float)):
        lower, upper = None, _to_float(value)
    elif isinstance(value, str):
        spec = value.strip()
        if "_" in spec:
            lo_text, hi_text = spec.split("_", 1)
            lower, upper = _to_float(lo_text), _to_float(hi_text)
            if lower is None or lower <= 0:
                raise bad
        else:
            lower, upper = None, _to_float(spec)
    else:
        raise bad
    if upper is None or upper <= 0 or (lower is not None and lower > upper):
        raise bad
    return lower, upper


def _split_list(value) -> list[str]:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [repr(float(value))]
    if isinstance(value, Iterable):  # a list, tuple or OmegaConf ListConfig
        return [str(part).strip() for part in value if str(part).strip()]
    return []


def parse_rs(rollout_rs, rollout_rs_threshold) -> list[tuple[str, float | None, float]]:
    """``rollout_rs`` + ``rollout_rs_threshold`` -> ``[(option, lower, upper), ...]`` in the order given.

    Thresholds are ratio bounds (not logs): one per option or one shared. k1 options take "lo_hi" or a single
    x (upper = x, lower = 1/x); k2/k3 options take only an upper bound (``lower`` is None). ``rollout_rs`` None
    (or empty list) means no rejection: ``[]``.
    """
    if rollout_rs is None:
        return []
    options = _split_list(rollout_rs)
    if isinstance(rollout_rs, bool) or not options:
        raise InputError(f"{_KEY}rollout_rs: expected a comma-separated list of {'|'.join(RS_OPTIONS)} "
                         f"or null, found {rollout_rs!r}")
    for option in options:
        if option not in RS_OPTIONS:
            raise InputError(f"{_KEY}rollout_rs: expected options among {'|'.join(RS_OPTIONS)}, found {option!r}")
    if len(set(options)) != len(options):
        raise InputError(f"{_KEY}rollout_rs: expected each option once, found {rollout_rs!r}")

    key = f"{_KEY}rollout_rs_threshold"
    if rollout_rs_threshold is None or isinstance(rollout_rs_threshold, bool):
        raise InputError(f"{key}: expected a threshold when rollout_rs is set ({rollout_rs!r}), "
                         f"found {rollout_rs_threshold!r}")
    specs = _split_list(rollout_rs_threshold)
    if len(specs) not in (1, len(options)):
        raise InputError(f"{key}: expected 1 threshold or {len(options)} (one per rollout_rs option), "
                         f"found {len(specs)} in {rollout_rs_threshold!r}")
    if len(specs) == 1:
        specs = specs * len(options)

    parsed: list[tuple[str, float | None, float]] = []
    for option, spec in zip(options, specs, strict=True):
        if option.endswith("k1"):
            expected = "a ratio bound x > 0 (bounds 1/x..x) or 'lower_upper' with 0 < lower <= upper"
            if "_" in spec:
                lo_text, hi_text = spec.split("_", 1)
                lower, upper = _to_float(lo_text), _to_float(hi_text)
            else:
                upper = _to_float(spec)
                lower = 1.0 / upper if upper else None
        else:
            expected = "a single upper bound > 0 (no '_': k2/k3 have no lower bound)"
            lower, upper = None, (None if "_" in spec else _to_float(spec))
        ok = upper is not None and upper > 0
        if option.endswith("k1"):
            ok = ok and lower is not None and 0 < lower <= upper
        if not ok:
            raise InputError(f"{key}: expected for {option} {expected}, found {spec!r}")
        parsed.append((option, lower, upper))
    return parsed


# --------------------------------------------------------------------------- small helpers
def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _check(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> None:
    if log_ratio.dim() != 2 or log_ratio.shape != response_mask.shape:
        raise ValueError(f"rollout correction: expected log-probs and response_mask of one [B, R] shape, "
                         f"found {tuple(log_ratio.shape)} and {tuple(response_mask.shape)}")
    if not bool(response_mask.bool().any()):
        raise ValueError("rollout correction: expected at least one valid token in response_mask, found none")


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _f(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _masked_std(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Population std of the masked values (0 for fewer than two)."""
    if mask.sum() <= 1:
        return 0.0
    mean = masked_mean(values, mask)
    return _f(masked_mean((values - mean) ** 2, mask).clamp_min(0).sqrt())


def _masked_extreme(values: torch.Tensor, mask: torch.Tensor, largest: bool) -> float:
    fill = -math.inf if largest else math.inf
    filled = values.masked_fill(~mask.bool(), fill)
    return _f(filled.max() if largest else filled.min())


def _row_summary(name: str, rows: torch.Tensor, center: float) -> dict[str, float]:
    """mean, std (unbiased), max, min and max |x - center| of per-row values."""
    return {
        f"{name}_seq_mean": _f(rows.mean()),
        f"{name}_seq_std": _f(rows.std()) if rows.numel() > 1 else 0.0,
        f"{name}_seq_max": _f(rows.max()),
        f"{name}_seq_min": _f(rows.min()),
        f"{name}_seq_max_deviation": _f((rows - center).abs().max()),
    }


def _global_mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """sum / count, both all-reduced over the default process group when torch.distributed is initialised."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pair = torch.stack([total.to(torch.float64), count.to(torch.float64)])
        torch.distributed.all_reduce(pair)
        total, count = pair[0].to(total.dtype), pair[1].to(total.dtype)
    return total / count if count > 0 else torch.zeros_like(total)


# --------------------------------------------------------------------------- importance sampling
@torch.no_grad()
def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    threshold,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """IS weights [B, R] (detached, 0 on padding) and their metrics.

    ``threshold`` is the ``rollout_is_threshold`` value (float or "lo_hi") or a ``(lower, upper)`` pair from
    :func:`parse_is_threshold`. Here "raw" weights are the safety-clamped, masked weights before TIS/IcePop; the
    "applied" weights are after TIS/IcePop and before batch normalisation. lower defaults to 1/upper for TIS.

    Metrics (``rollout_corr/rollout_is_*``), as verl computes them:
    - ``mean``: masked token mean of the applied weights.
    - ``max``/``min``: token level, of the applied weights; sequence level, pre-truncation: exp of the row
      log-ratio sums without the safety clamp (max capped at exp(20)), over rows.
    - ``ratio_fraction_high``/``_low``: pre-truncation: token level, fraction of valid tokens whose raw weight is
      > upper / < lower; sequence level, fraction of rows whose unclamped log sum is > log(upper) / < log(lower).
    - ``std``: population std over valid tokens of the applied weights clamped to [0, upper].
    - ``eff_sample_size``: ``1 / mean((w / mean(w))²)`` over valid tokens, w = applied weights clamped to
      [0, upper] (0 if every weight is 0).
    - ``seq_mean``/``_std`` (unbiased)/``_max``/``_min``/``_max_deviation`` (max |x - 1|): over rows of the
      per-row masked mean of the applied weights.
    - ``seq_fraction_high``/``_low``: pre-truncation: rows whose masked mean raw weight is > upper / < lower.
    - ``oob_ratio`` (IcePop only): fraction of valid tokens whose raw weight is outside [lo, hi].
    - ``batch_norm_factor`` (normalisation only): the mean divided by (1.0 when it is <= 1e-8 and skipped).
    """
    if rollout_is not in IS_LEVELS:
        raise InputError(f"{_KEY}rollout_is: expected one of {list(IS_LEVELS)} or null, found {rollout_is!r}")
    lower, upper = threshold if isinstance(threshold, tuple) else parse_is_threshold(threshold)
    _check(log_ratio, response_mask)
    dtype = _work_dtype(log_ratio)
    lr = log_ratio.detach().to(dtype)
    mask = response_mask.to(dtype)
    rows_valid = response_mask.bool().any(dim=-1)

    if rollout_is == "token":
        raw = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask
    else:
        row_sum = (lr * mask).sum(dim=-1, keepdim=True)  # unclamped: the metrics read it too
        raw = torch.exp(row_sum.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(lr) * mask

    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))

    # ---- metrics (applied weights before normalisation)
    metric_lower = lower if lower is not None else 1.0 / upper
    m: dict[str, float] = {"rollout_is_mean": _f(masked_mean(weights, mask))}
    if rollout_is == "token":
        m["rollout_is_max"] = _masked_extreme(weights, mask, largest=True)
        m["rollout_is_min"] = _masked_extreme(weights, mask, largest=False)
        m["rollout_is_ratio_fraction_high"] = _f(masked_mean((raw > upper).to(dtype), mask))
        m["rollout_is_ratio_fraction_low"] = _f(masked_mean((raw < metric_lower).to(dtype), mask))
    else:
        sums = row_sum.squeeze(-1)[rows_valid]
        m["rollout_is_max"] = _f(torch.exp(sums.max().clamp(max=SAFETY_BOUND)))
        m["rollout_is_min"] = _f(torch.exp(sums.min()))
        m["rollout_is_ratio_fraction_high"] = _f((sums > _log(upper)).to(dtype).mean())
        m["rollout_is_ratio_fraction_low"] = _f((sums < _log(metric_lower)).to(dtype).mean())
    bounded = weights.clamp(0.0, upper)
    m["rollout_is_std"] = _masked_std(bounded, mask)
    bounded_mean = masked_mean(bounded, mask)
    second = _f(masked_mean((bounded / (bounded_mean + 1e-8)) ** 2, mask))
    m["rollout_is_eff_sample_size"] = 1.0 / second if second > 0 else 0.0
    row_weights = masked_mean(weights, mask, axis=-1)[rows_valid]
    m.update(_row_summary("rollout_is", row_weights, 1.0))
    raw_rows = masked_mean(raw, mask, axis=-1)[rows_valid]
    m["rollout_is_seq_fraction_high"] = _f((raw_rows > upper).to(dtype).mean())
    m["rollout_is_seq_fraction_low"] = _f((raw_rows < metric_lower).to(dtype).mean())
    if lower is not None:
        outside = (raw < lower) | (raw > upper)
        m["rollout_is_oob_ratio"] = _f(masked_mean(outside.to(dtype), mask))

    if batch_normalize:
        if rollout_is == "token":
            mean = _global_mean((weights * mask).sum(), mask.sum())
        else:
            row_means = masked_mean(weights, mask, axis=-1)
            mean = _global_mean(row_means[rows_valid].sum(), rows_valid.sum().to(dtype))
        if mean > 1e-8:
            weights = weights / mean
            m["rollout_is_batch_norm_factor"] = _f(mean)
        else:
            m["rollout_is_batch_norm_factor"] = 1.0

    return weights.detach(), {PREFIX + k: v for k, v in m.items()}


# --------------------------------------------------------------------------- rejection sampling
@torch.no_grad()
def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    options,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``response_mask * keep`` (dtype of ``response_mask``) and the rejection metrics.

    ``options`` is :func:`parse_rs`'s list of ``(option, lower, upper)``. Per option ``rollout_corr/rollout_rs_{opt}``:
    ``_mean`` (masked token mean of the statistic; a row statistic counts once per valid token), ``_max``/``_min``
    (over rows for seq options, valid tokens for token options), ``_fraction_high``/``_low`` (share above
    the upper / below the lower bound, in log space for k1; ``_low`` is 0 for k2/k3), ``_std`` (population std over
    valid tokens of the statistic clamped to [lower or 0, upper]), ``_seq_mean``/``_seq_std``/``_seq_max``/``_seq_min``
    /``_seq_max_deviation`` (of per-row statistics: the row statistic, or the row mean for token options;
    deviation from 0), ``_seq_fraction_high`` (and ``_seq_fraction_low`` for k1), ``_masked_fraction`` (valid tokens
    this option rejects), ``_seq_masked_fraction`` (rows with a token it rejects). Overall:
    ``rollout_rs_masked_fraction`` and ``rollout_rs_seq_masked_fraction`` for the ANDed mask.
    """
    _check(log_ratio, response_mask)
    dtype = _work_dtype(log_ratio)
    lr = log_ratio.detach().to(dtype).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    mask = response_mask.to(dtype)
    valid = response_mask.bool()
    rows_valid = valid.any(dim=-1)
    per_token = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1.0 - lr}

    keep = torch.ones_like(valid)
    m: dict[str, float] = {}
    for option, lower, upper in options:
        kind = option[-2:]
        stat = per_token[kind]
        if option.startswith("token_"):
            token_stat, row_stat = stat, masked_mean(stat, mask, axis=-1)
        else:
            if option.startswith("seq_sum_"):
                row_stat = (stat * mask).sum(dim=-1)
            elif option.startswith("seq_mean_"):
                row_stat = masked_mean(stat, mask, axis=-1)
            else:  # seq_max_
                row_stat = stat.masked_fill(~valid, -math.inf).max(dim=-1).values
                row_stat = torch.where(rows_valid, row_stat, torch.zeros_like(row_stat))
            token_stat = row_stat.unsqueeze(-1).expand_as(stat)
        hi = _log(upper) if kind == "k1" else upper
        lo = _log(lower) if kind == "k1" else None
        option_keep = token_stat <= hi
        if lo is not None:
            option_keep &= token_stat >= lo
        keep &= option_keep

        name = f"rollout_rs_{option}"
        rows = row_stat[rows_valid]
        is_seq = not option.startswith("token_")
        m[f"{name}_mean"] = _f(masked_mean(token_stat, mask))
        if is_seq:
            m[f"{name}_max"], m[f"{name}_min"] = _f(rows.max()), _f(rows.min())
            m[f"{name}_fraction_high"] = _f((rows > hi).to(dtype).mean())
            m[f"{name}_fraction_low"] = _f((rows < lo).to(dtype).mean()) if lo is not None else 0.0
        else:
            m[f"{name}_max"] = _masked_extreme(token_stat, mask, largest=True)
            m[f"{name}_min"] = _masked_extreme(token_stat, mask, largest=False)
            m[f"{name}_fraction_high"] = _f(masked_mean((token_stat > hi).to(dtype), mask))
            m[f"{name}_fraction_low"] = _f(masked_mean((token_stat < lo).to(dtype), mask)) if lo is not None else 0.0
        m[f"{name}_std"] = _masked_std(token_stat.clamp(lo if lo is not None else 0.0, hi), mask)
        m.update(_row_summary(name, rows, 0.0))
        m[f"{name}_seq_fraction_high"] = _f((rows > hi).to(dtype).mean())
        if lo is not None:
            m[f"{name}_seq_fraction_low"] = _f((rows < lo).to(dtype).mean())
        rejected = valid & ~option_keep
        m[f"{name}_masked_fraction"] = _f(masked_mean(rejected.to(dtype), mask))
        m[f"{name}_seq_masked_fraction"] = _f(rejected.any(dim=-1)[rows_valid].to(dtype).mean())

    rejected = valid & ~keep
    m["rollout_rs_masked_fraction"] = _f(masked_mean(rejected.to(dtype), mask))
    m["rollout_rs_seq_masked_fraction"] = _f(rejected.any(dim=-1)[rows_valid].to(dtype).mean())
    new_mask = (valid & keep).to(response_mask.dtype)
    return new_mask, {PREFIX + k: v for k, v in m.items()}


# --------------------------------------------------------------------------- diagnostics
@torch.no_grad()
def off_policy_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """Mismatch diagnostics between π_old (training) and π_rollout, keys ``rollout_corr/...``.

    Per row i with valid tokens T_i: ``log_ppl_i = -mean_{t∈T_i} log π(t)``; ``ppl = mean_i exp(log_ppl_i)``,
    ``log_ppl = mean_i log_ppl_i`` (training_* from old_log_prob, rollout_* from rollout_log_prob), means over the
    rows with at least one valid token (verl averages over every row; a row with no valid token would count as
    ppl 1 there). ``d_i = log_ppl_train_i - log_ppl_rollout_i``: log_ppl_diff = mean d_i, log_ppl_abs_diff =
    mean |d_i|, log_ppl_diff_max/min, ppl_ratio = mean exp(d_i). Token means over valid tokens, lr = old - rollout:
    kl = mean(rollout - old), k3_kl = mean(exp(lr) - 1 - lr), chi2_token = mean(exp(2 lr)) - 1; per row
    chi2_seq = mean_i exp(2 Σ_t lr) - 1. Every exponent is clamped to ±20 (verl leaves k3_kl's unclamped).
    """
    _check(old_log_prob, response_mask)
    if rollout_log_prob.shape != old_log_prob.shape:
        raise ValueError(f"rollout correction: expected rollout_log_prob of shape {tuple(old_log_prob.shape)}, "
                         f"found {tuple(rollout_log_prob.shape)}")
    dtype = _work_dtype(old_log_prob)
    old, rollout = old_log_prob.detach().to(dtype), rollout_log_prob.detach().to(dtype)
    mask = response_mask.to(dtype)
    rows_valid = response_mask.bool().any(dim=-1)
    lr = old - rollout
    lr_safe = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)

    train_log_ppl = -masked_mean(old, mask, axis=-1)[rows_valid]
    rollout_log_ppl = -masked_mean(rollout, mask, axis=-1)[rows_valid]
    diff = train_log_ppl - rollout_log_ppl
    row_lr_sum = (lr * mask).sum(dim=-1)[rows_valid].clamp(-SAFETY_BOUND, SAFETY_BOUND)
    m = {
        "training_ppl": _f(torch.exp(train_log_ppl).mean()),
        "training_log_ppl": _f(train_log_ppl.mean()),
        "kl": _f(masked_mean(rollout - old, mask)),
        "k3_kl": _f(masked_mean(torch.exp(lr_safe) - 1.0 - lr_safe, mask)),
        "rollout_ppl": _f(torch.exp(rollout_log_ppl).mean()),
        "rollout_log_ppl": _f(rollout_log_ppl.mean()),
        "log_ppl_diff": _f(diff.mean()),
        "log_ppl_abs_diff": _f(diff.abs().mean()),
        "log_ppl_diff_max": _f(diff.max()),
        "log_ppl_diff_min": _f(diff.min()),
        "ppl_ratio": _f(torch.exp(diff).mean()),
        "chi2_token": _f(masked_mean(torch.exp(2.0 * lr_safe), mask) - 1.0),
        "chi2_seq": _f(torch.exp(2.0 * row_lr_sum).mean() - 1.0),
    }
    return {PREFIX + k: v for k, v in m.items()}


# --------------------------------------------------------------------------- the whole step
@torch.no_grad()
def apply_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None,
    rollout_is_threshold,
    rollout_rs,
    rollout_rs_threshold,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """verl's decoupled-mode correction: ``(response_mask after rejection, IS weights or None, metrics)``.

    ``log_ratio = old_log_prob - rollout_log_prob``. As in verl, the IS weights and the rejection mask are both
    computed from the ``response_mask`` given (the weights, their batch normalisation and their metrics do not
    see the rejection); the loss multiplies by the weights and masks with the returned mask. The off-policy
    diagnostics are always computed, also with IS and RS both off. The returned mask is a new tensor.
    """
    rs_options = parse_rs(rollout_rs, rollout_rs_threshold)  # config errors before any tensor work
    if rollout_is is not None:
        if rollout_is not in IS_LEVELS:
            raise InputError(f"{_KEY}rollout_is: expected one of {list(IS_LEVELS)} or null, found {rollout_is!r}")
        is_bounds = parse_is_threshold(rollout_is_threshold)
    _check(old_log_prob, response_mask)
    log_ratio = old_log_prob.detach() - rollout_log_prob.detach()
    metrics: dict[str, float] = {}

    weights = None
    if rollout_is is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio, response_mask, rollout_is, is_bounds, batch_normalize=batch_normalize)
        metrics.update(is_metrics)

    new_mask = response_mask.clone()
    if rs_options:
        new_mask, rs_metrics = compute_rollout_rejection_mask(log_ratio, response_mask, rs_options)
        metrics.update(rs_metrics)

    metrics.update(off_policy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return new_mask, weights, metrics
