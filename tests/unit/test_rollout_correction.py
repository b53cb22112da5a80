"""verl's rollout correction (IS weights, rejection sampling, off-policy metrics) against float64 loop oracles.

Tolerance: the module runs in float32; the oracles below loop over rows and tokens in float64. A float32 exp
is correct to ~1 ulp (6e-8 relative) and a float32 sum of at most 64 log-ratios of magnitude <= ~0.2 is off by
far less than 64 * 1.2e-7 * sum|x| in the worst case (~1e-6 typically), so rtol=1e-5 with atol=1e-6 (for
weights and statistics near 0) leaves a ~10x margin while a formula error (a missing mask, a mean for a sum,
a wrong clamp) moves values by orders of magnitude more. Rejection masks are compared exactly, with thresholds
placed midway between two oracle statistics that are further apart than that tolerance.
"""

import math

import pytest
import torch

from verl.algorithms.rollout_correction import (
    SAFETY_BOUND,
    apply_rollout_correction,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
    off_policy_metrics,
    parse_is_threshold,
    parse_rs,
)
from verl.errors import InputError

pytestmark = pytest.mark.unit

RTOL, ATOL = 1e-5, 1e-6
LN2 = math.log(2.0)


def close(actual, expected, rtol=RTOL, atol=ATOL):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def make_batch(seed=0, rows=8, width=64, scale=0.05, lengths=(64, 1, 37, 5, 64, 20, 50, 12)):
    """float32 log-probs with right padding (lengths per row); log_ratio ~ N(0, scale)."""
    g = torch.Generator().manual_seed(seed)
    old = -(torch.rand(rows, width, generator=g) * 2.0 + 0.05)
    rollout = old - scale * torch.randn(rows, width, generator=g)
    mask = torch.zeros(rows, width)
    for i, n in enumerate(lengths[:rows]):
        mask[i, :n] = 1
    # padding holds garbage, as batches do: it must never leak into a result
    old = torch.where(mask.bool(), old, torch.full_like(old, -50.0))
    return old, rollout, mask


def as_lists(old, rollout, mask):
    return old.double().tolist(), rollout.double().tolist(), mask.tolist()


def valid_tokens(mask_row):
    return [t for t, m in enumerate(mask_row) if m]


def clamp(x, bound=SAFETY_BOUND):
    return min(max(x, -bound), bound)


# --------------------------------------------------------------------------- oracles (float64 loops)
def ref_is_weights(old, rollout, mask, level, lower, upper):
    """Per-token weights: token exp(lr), sequence prod_t exp(lr_t) (held within exp(±20)); TIS or IcePop."""
    out = [[0.0] * len(mask[0]) for _ in mask]
    for i, row in enumerate(mask):
        toks = valid_tokens(row)
        if level == "sequence":
            product = math.prod(math.exp(old[i][t] - rollout[i][t]) for t in toks)
            row_w = min(max(product, math.exp(-SAFETY_BOUND)), math.exp(SAFETY_BOUND))
        for t in toks:
            w = row_w if level == "sequence" else math.exp(clamp(old[i][t] - rollout[i][t]))
            if lower is None:
                w = min(w, upper)
            elif not lower <= w <= upper:
                w = 0.0
            out[i][t] = w
    return out


def ref_normalize(weights, mask, level):
    if level == "token":
        vals = [weights[i][t] for i, row in enumerate(mask) for t in valid_tokens(row)]
    else:
        vals = [weights[i][valid_tokens(row)[0]] for i, row in enumerate(mask) if valid_tokens(row)]
    mean = sum(vals) / len(vals)
    return [[w / mean for w in row] for row in weights], mean


def ref_token_stats(old, rollout, mask, kind):
    """Per-row list of the per-token statistic on the clamped log-ratio."""
    def stat(lr):
        lr = clamp(lr)
        return {"k1": -lr, "k2": 0.5 * lr * lr, "k3": math.exp(lr) - 1.0 - lr}[kind]
    return [[stat(old[i][t] - rollout[i][t]) for t in valid_tokens(row)] for i, row in enumerate(mask)]


def ref_keep(old, rollout, mask, option, lower, upper):
    """Per-token keep flags of one rejection option."""
    level, kind = option.rsplit("_", 1)
    stats = ref_token_stats(old, rollout, mask, kind)

    def passes(x):
        return math.log(lower) <= x <= math.log(upper) if kind == "k1" else x <= upper

    keep = [[True] * len(mask[0]) for _ in mask]
    for i, row in enumerate(mask):
        toks = valid_tokens(row)
        if level == "token":
            for t, x in zip(toks, stats[i], strict=True):
                keep[i][t] = passes(x)
        else:
            agg = {"seq_sum": sum, "seq_mean": lambda v: sum(v) / len(v), "seq_max": max}[level]
            row_keep = passes(agg(stats[i])) if toks else True
            keep[i] = [row_keep] * len(row)
    return keep


def midpoint_threshold(values, quantile):
    """A threshold between two neighbouring sorted values near ``quantile``, far from both (margin checked)."""
    vals = sorted(set(values))
    start = max(1, min(len(vals) - 1, int(quantile * len(vals))))
    for k in sorted(range(1, len(vals)), key=lambda j: abs(j - start)):  # the nearest gap wide enough
        lo, hi = vals[k - 1], vals[k]
        if hi - lo > 1e-4 * max(1.0, abs(hi)):  # >> float32 error of a statistic (<= 1e-6 here)
            return 0.5 * (lo + hi)
    raise AssertionError("statistics too close to place a safe threshold")


def mask_from_keep(mask, keep):
    return [[float(m and k) for m, k in zip(mr, kr, strict=True)] for mr, kr in zip(mask, keep, strict=True)]


# --------------------------------------------------------------------------- importance sampling
def test_token_tis_matches_oracle():
    old, rollout, mask = make_batch(seed=1, scale=0.3)
    o, r, m = as_lists(old, rollout, mask)
    weights, metrics = compute_rollout_correction_weights(old - rollout, mask, "token", 1.2)
    close(weights, ref_is_weights(o, r, m, "token", None, 1.2))
    assert (weights == 1.2).any() and (weights[mask.bool()] < 1.2).any()  # both regimes exercised
    raw = ref_is_weights(o, r, m, "token", None, math.inf)
    toks = [(i, t) for i, row in enumerate(m) for t in valid_tokens(row)]
    close(metrics["rollout_corr/rollout_is_ratio_fraction_high"], sum(raw[i][t] > 1.2 for i, t in toks) / len(toks))
    close(metrics["rollout_corr/rollout_is_ratio_fraction_low"],
          sum(raw[i][t] < 1 / 1.2 for i, t in toks) / len(toks))


def test_sequence_tis_is_product_of_ratios():
    old, rollout, mask = make_batch(seed=2, scale=0.05)
    o, r, m = as_lists(old, rollout, mask)
    threshold = 1.1
    weights, _ = compute_rollout_correction_weights(old - rollout, mask, "sequence", threshold)
    expected = ref_is_weights(o, r, m, "sequence", None, threshold)
    close(weights, expected)
    assert (weights == threshold).any() and (weights[mask.bool()] < threshold).any()
    for i, row in enumerate(m):  # one weight per row, on every valid token
        toks = valid_tokens(row)
        assert torch.unique(weights[i, toks]).numel() == 1


def test_sequence_weights_held_at_safety_bound_on_huge_sums():
    mask = torch.zeros(3, 40)
    mask[0, :30] = mask[1, :30] = mask[2, :4] = 1
    log_ratio = torch.zeros(3, 40)
    log_ratio[0, :30], log_ratio[1, :30], log_ratio[2, :4] = 2.0, -2.0, 0.1  # row sums +60, -60, 0.4
    log_ratio[2, 4:] = 500.0  # padding: must not count
    weights, metrics = compute_rollout_correction_weights(log_ratio, mask, "sequence", 1e12)
    close(weights[0, :30], [math.exp(20.0)] * 30)
    close(weights[1, :30], [math.exp(-20.0)] * 30, atol=0)
    close(weights[2, :4], [math.exp(0.4)] * 4)
    assert torch.all(weights[mask == 0] == 0)
    close(metrics["rollout_corr/rollout_is_max"], math.exp(20.0))  # capped at exp(20)
    close(metrics["rollout_corr/rollout_is_min"], math.exp(-60.0), atol=0)  # unclamped log-sum
    close(metrics["rollout_corr/rollout_is_ratio_fraction_low"], 1 / 3)  # -60 < log(1e-12) = -27.6


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_icepop_zeroes_outside_band_and_keeps_mask(level):
    old, rollout, mask = make_batch(seed=3, scale=0.2 if level == "token" else 0.03)
    o, r, m = as_lists(old, rollout, mask)
    lo, hi = 0.8, 1.25
    weights, metrics = compute_rollout_correction_weights(old - rollout, mask, level, f"{lo}_{hi}")
    expected = ref_is_weights(o, r, m, level, lo, hi)
    close(weights, expected)
    valid = mask.bool()
    assert (weights[valid] == 0).any() and (weights[valid] > 0).any()
    raw = ref_is_weights(o, r, m, level, None, math.inf)
    toks = [(i, t) for i, row in enumerate(m) for t in valid_tokens(row)]
    close(metrics["rollout_corr/rollout_is_oob_ratio"], sum(not lo <= raw[i][t] <= hi for i, t in toks) / len(toks))
    new_mask, w2, _ = apply_rollout_correction(old, rollout, mask, level, f"{lo}_{hi}", None, None)
    assert torch.equal(new_mask, mask) and torch.equal(w2, weights)


@pytest.mark.parametrize("level,threshold", [("token", 1.3), ("sequence", 1.05), ("token", "0.8_1.25")])
def test_batch_normalization(level, threshold):
    old, rollout, mask = make_batch(seed=4, scale=0.2 if level == "token" else 0.03)
    o, r, m = as_lists(old, rollout, mask)
    lower, upper = parse_is_threshold(threshold)
    weights, metrics = compute_rollout_correction_weights(old - rollout, mask, level, threshold, batch_normalize=True)
    expected, mean = ref_normalize(ref_is_weights(o, r, m, level, lower, upper), m, level)
    close(weights, expected)
    close(metrics["rollout_corr/rollout_is_batch_norm_factor"], mean)
    plain, plain_metrics = compute_rollout_correction_weights(old - rollout, mask, level, threshold)
    assert "rollout_corr/rollout_is_batch_norm_factor" not in plain_metrics
    # the other metrics describe the weights before normalisation
    assert {k: v for k, v in metrics.items() if "batch_norm" not in k} == plain_metrics


def test_batch_normalization_skipped_when_mean_is_zero():
    log_ratio, mask = torch.full((2, 4), 3.0), torch.ones(2, 4)  # every ratio e^3: IcePop zeroes all
    weights, metrics = compute_rollout_correction_weights(log_ratio, mask, "token", "0.5_2", batch_normalize=True)
    assert torch.all(weights == 0)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == 1.0
    assert metrics["rollout_corr/rollout_is_eff_sample_size"] == 0.0


def _normalize_on_ranks(rank, world_size, log_ratio, mask, level):
    rows = slice(rank * 4, rank * 4 + 4)
    weights, metrics = compute_rollout_correction_weights(log_ratio[rows], mask[rows], level, 1.2,
                                                          batch_normalize=True)
    return {"weights": weights, "factor": metrics["rollout_corr/rollout_is_batch_norm_factor"]}


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalization_uses_global_mean_across_ranks(level):
    from verl.launcher.spawn import run_ranks_with_rank

    old, rollout, mask = make_batch(seed=5, scale=0.1 if level == "token" else 0.02)
    full, full_metrics = compute_rollout_correction_weights(old - rollout, mask, level, 1.2, batch_normalize=True)
    results = run_ranks_with_rank(_normalize_on_ranks, 2, old - rollout, mask, level)
    close(torch.cat([res["weights"] for res in results]), full)
    for res in results:
        close(res["factor"], full_metrics["rollout_corr/rollout_is_batch_norm_factor"])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "0.5_2.0"])
def test_weights_detached_and_zero_on_padding(level, threshold):
    old, rollout, mask = make_batch(seed=6, scale=0.05)
    old.requires_grad_(True)
    _, weights, _ = apply_rollout_correction(old, rollout, mask, level, threshold, None, None, batch_normalize=True)
    assert not weights.requires_grad and weights.grad_fn is None
    assert torch.all(weights[mask == 0] == 0)


# --------------------------------------------------------------------------- rejection sampling
def _rs_case(option, quantile, seed, two_sided_quantile=None):
    """Thresholds placed between oracle statistics, so that some rows/tokens are kept and some rejected."""
    old, rollout, mask = make_batch(seed=seed, scale=0.1)
    o, r, m = as_lists(old, rollout, mask)
    level, kind = option.rsplit("_", 1)
    stats = ref_token_stats(o, r, m, kind)
    agg = {"token": None, "seq_sum": sum, "seq_mean": lambda v: sum(v) / len(v), "seq_max": max}[level]
    values = [x for row in stats for x in row] if agg is None else [agg(row) for row in stats if row]
    upper = midpoint_threshold(values, quantile)
    if kind == "k1":
        lower = midpoint_threshold(values, two_sided_quantile)
        return old, rollout, mask, (option, math.exp(lower), math.exp(upper))
    return old, rollout, mask, (option, None, upper)


@pytest.mark.parametrize("option,quantile,low_quantile", [
    ("token_k1", 0.85, 0.2),     # two-sided on -lr per token
    ("seq_mean_k1", 0.7, 0.3),   # "geometric" RS
    ("seq_sum_k1", 0.8, 0.2),
    ("token_k2", 0.7, None), ("token_k3", 0.7, None),
    ("seq_sum_k2", 0.6, None), ("seq_sum_k3", 0.6, None),
    ("seq_mean_k2", 0.6, None), ("seq_mean_k3", 0.6, None),
    ("seq_max_k2", 0.6, None), ("seq_max_k3", 0.6, None),
])
def test_rejection_option_matches_oracle(option, quantile, low_quantile):
    old, rollout, mask, spec = _rs_case(option, quantile, seed=7, two_sided_quantile=low_quantile)
    o, r, m = as_lists(old, rollout, mask)
    new_mask, metrics = compute_rollout_rejection_mask(old - rollout, mask, [spec])
    keep = ref_keep(o, r, m, *spec)
    expected = mask_from_keep(m, keep)
    assert new_mask.tolist() == expected
    valid = mask.bool()
    assert (new_mask[valid] == 0).any() and (new_mask[valid] == 1).any()
    n_valid = int(mask.sum())
    rejected = sum(mk and not k for mr, kr in zip(m, keep, strict=True) for mk, k in zip(mr, kr, strict=True))
    close(metrics[f"rollout_corr/rollout_rs_{option}_masked_fraction"], rejected / n_valid)
    close(metrics["rollout_corr/rollout_rs_masked_fraction"], rejected / n_valid)
    rows_rejected = sum(any(mk and not k for mk, k in zip(mr, kr, strict=True)) for mr, kr in zip(m, keep, strict=True))
    close(metrics[f"rollout_corr/rollout_rs_{option}_seq_masked_fraction"], rows_rejected / len(m))


def test_seq_mean_k1_is_geometric_mean_band():
    """seq_mean_k1 keeps a row iff lower <= (prod_t pi_rollout/pi_old)^(1/n) <= upper."""
    old, rollout, mask = make_batch(seed=8, scale=0.1)
    o, r, m = as_lists(old, rollout, mask)
    geo = []
    for i, row in enumerate(m):
        toks = valid_tokens(row)
        geo.append(math.prod(math.exp(r[i][t] - o[i][t]) for t in toks) ** (1 / len(toks)))
    lo, hi = midpoint_threshold(geo, 0.25), midpoint_threshold(geo, 0.75)
    new_mask, _ = compute_rollout_rejection_mask(old - rollout, mask, parse_rs("seq_mean_k1", f"{lo}_{hi}"))
    expected = [[float(mk and lo <= g <= hi) for mk in mr] for mr, g in zip(m, geo, strict=True)]
    assert new_mask.tolist() == expected


def test_single_k1_threshold_is_symmetric_band():
    log_ratio = torch.tensor([[0.0, 0.3, -0.3, 0.05, -0.05, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    new_mask, _ = compute_rollout_rejection_mask(log_ratio, mask, parse_rs("token_k1", 1.2))  # |lr| <= log 1.2
    assert new_mask.dtype == torch.bool
    assert new_mask.tolist() == [[True, False, False, True, True, False]]


def test_rejection_options_are_anded():
    old, rollout, mask = make_batch(seed=9, scale=0.1)
    o, r, m = as_lists(old, rollout, mask)
    *_, spec_a = _rs_case("token_k1", 0.9, seed=9, two_sided_quantile=0.1)
    *_, spec_b = _rs_case("seq_max_k3", 0.6, seed=9)
    *_, spec_c = _rs_case("seq_sum_k2", 0.7, seed=9)
    specs = [spec_a, spec_b, spec_c]
    new_mask, metrics = compute_rollout_rejection_mask(old - rollout, mask, specs)
    keeps = [ref_keep(o, r, m, *s) for s in specs]
    keep = [[all(k[i][t] for k in keeps) for t in range(len(m[0]))] for i in range(len(m))]
    assert new_mask.tolist() == mask_from_keep(m, keep)
    singles = [compute_rollout_rejection_mask(old - rollout, mask, [s])[0] for s in specs]
    assert torch.equal(new_mask, singles[0] * singles[1] * singles[2])
    assert all(new_mask.sum() < s.sum() for s in singles)  # each option rejects something the others keep
    # the same through the config strings
    thresholds = f"{spec_a[1]}_{spec_a[2]},{spec_b[2]},{spec_c[2]}"
    via_config, _, metrics2 = apply_rollout_correction(old, rollout, mask, None, 2.0,
                                                       "token_k1,seq_max_k3,seq_sum_k2", thresholds)
    assert torch.equal(via_config, new_mask)
    assert all(metrics2[k] == v for k, v in metrics.items())


def test_apply_computes_weights_on_the_given_mask():
    old, rollout, mask = make_batch(seed=10, scale=0.1)
    new_mask, weights, metrics = apply_rollout_correction(old, rollout, mask, "token", 1.5, "token_k2", 0.002,
                                                          batch_normalize=True)
    assert new_mask.sum() < mask.sum()
    expected, _ = compute_rollout_correction_weights(old - rollout, mask, "token", 1.5, batch_normalize=True)
    assert torch.equal(weights, expected)
    assert {k for k in metrics if "training_ppl" in k or "chi2" in k}
    assert all(isinstance(v, float) for v in metrics.values())
    assert all(k.startswith("rollout_corr/") for k in metrics)


def test_apply_with_nothing_enabled_reports_diagnostics_only():
    old, rollout, mask = make_batch(seed=11)
    new_mask, weights, metrics = apply_rollout_correction(old, rollout, mask, None, 2.0, None, None)
    assert weights is None and torch.equal(new_mask, mask) and new_mask is not mask
    assert metrics == off_policy_metrics(old, rollout, mask)


# --------------------------------------------------------------------------- hand-computed metrics
def _hand_batch():
    # rows: [log .5, log .25 | pad] and [log .5 | pad, pad] under pi_old; pi_rollout [log .25, log .25], [log 1]
    old = torch.tensor([[math.log(0.5), math.log(0.25), -9.0], [math.log(0.5), -9.0, -9.0]])
    rollout = torch.tensor([[math.log(0.25), math.log(0.25), 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return old, rollout, mask  # log_ratio on valid tokens: [ln 2, 0], [-ln 2]; raw token weights 2, 1, 0.5


def test_is_metrics_hand_computed():
    old, rollout, mask = _hand_batch()
    weights, m = compute_rollout_correction_weights(old - rollout, mask, "token", 1.5)
    close(weights, [[1.5, 1.0, 0.0], [0.5, 0.0, 0.0]])
    p = "rollout_corr/rollout_is_"
    expected = {
        "mean": 1.0, "max": 1.5, "min": 0.5,
        "ratio_fraction_high": 1 / 3, "ratio_fraction_low": 1 / 3,  # raw 2 > 1.5; raw 0.5 < 1/1.5
        "std": math.sqrt(((1.5 - 1) ** 2 + 0 + (0.5 - 1) ** 2) / 3),
        "eff_sample_size": 1 / ((1.5**2 + 1 + 0.5**2) / 3),
        "seq_mean": (1.25 + 0.5) / 2, "seq_std": 0.75 / math.sqrt(2), "seq_max": 1.25, "seq_min": 0.5,
        "seq_max_deviation": 0.5,
        "seq_fraction_high": 0.0, "seq_fraction_low": 0.5,  # raw row means 1.5 (not > 1.5) and 0.5
    }
    assert set(m) == {p + k for k in expected}
    for k, v in expected.items():
        close(m[p + k], v)

    _, seq = compute_rollout_correction_weights(old - rollout, mask, "sequence", 1.5)  # row weights 2 -> 1.5, 0.5
    close(seq[p + "max"], 2.0)
    close(seq[p + "min"], 0.5)
    close(seq[p + "mean"], (1.5 + 1.5 + 0.5) / 3)
    close(seq[p + "ratio_fraction_high"], 0.5)
    close(seq[p + "ratio_fraction_low"], 0.5)


def test_rs_metrics_hand_computed():
    old, rollout, mask = _hand_batch()
    new_mask, m = compute_rollout_rejection_mask(old - rollout, mask, parse_rs("token_k1,seq_sum_k2", "1.5,0.2"))
    # k1 = -lr = [-ln2, 0], [ln2]: |k1| = ln 2 > ln 1.5 rejects two tokens; seq_sum_k2 = ln2^2/2 = 0.24 > 0.2
    assert new_mask.tolist() == [[0, 0, 0], [0, 0, 0]]
    p = "rollout_corr/rollout_rs_token_k1_"
    close(m[p + "mean"], 0.0)
    close(m[p + "max"], LN2)
    close(m[p + "min"], -LN2)
    close(m[p + "fraction_high"], 1 / 3)
    close(m[p + "fraction_low"], 1 / 3)
    close(m[p + "masked_fraction"], 2 / 3)
    close(m[p + "seq_masked_fraction"], 1.0)
    close(m[p + "seq_mean"], (-LN2 / 2 + LN2) / 2)  # row means of k1: -ln2/2, ln2
    q = "rollout_corr/rollout_rs_seq_sum_k2_"
    close(m[q + "mean"], LN2**2 / 2)
    close(m[q + "max"], LN2**2 / 2)
    close(m[q + "masked_fraction"], 1.0)
    close(m[q + "seq_fraction_high"], 1.0)
    assert q + "seq_fraction_low" not in m and m[q + "fraction_low"] == 0.0
    close(m["rollout_corr/rollout_rs_masked_fraction"], 1.0)
    close(m["rollout_corr/rollout_rs_seq_masked_fraction"], 1.0)


def test_off_policy_metrics_hand_computed():
    old, rollout, mask = _hand_batch()
    m = {k.removeprefix("rollout_corr/"): v for k, v in off_policy_metrics(old, rollout, mask).items()}
    # per-row log ppl: training 1.5 ln2 and ln2; rollout 2 ln2 and 0; d = training - rollout = -ln2/2, ln2
    expected = {
        "training_log_ppl": 1.25 * LN2, "training_ppl": (2**1.5 + 2) / 2,
        "rollout_log_ppl": LN2, "rollout_ppl": (4 + 1) / 2,
        "kl": 0.0,  # mean of rollout - old over tokens: -ln2, 0, ln2
        "k3_kl": ((1 - LN2) + 0 + (LN2 - 0.5)) / 3,  # exp(lr) - 1 - lr
        "log_ppl_diff": 0.25 * LN2, "log_ppl_abs_diff": 0.75 * LN2,
        "log_ppl_diff_max": LN2, "log_ppl_diff_min": -0.5 * LN2,
        "ppl_ratio": (2**-0.5 + 2) / 2,
        "chi2_token": (4 + 1 + 0.25) / 3 - 1, "chi2_seq": (4 + 0.25) / 2 - 1,
    }
    assert set(m) == set(expected)
    for k, v in expected.items():
        close(m[k], v)


def test_off_policy_metrics_match_oracle_on_random_batch():
    old, rollout, mask = make_batch(seed=12, scale=0.05)
    o, r, mk = as_lists(old, rollout, mask)
    rows = [valid_tokens(row) for row in mk]
    train = [-sum(o[i][t] for t in toks) / len(toks) for i, toks in enumerate(rows)]
    roll = [-sum(r[i][t] for t in toks) / len(toks) for i, toks in enumerate(rows)]
    toks = [(i, t) for i, ts in enumerate(rows) for t in ts]
    m = off_policy_metrics(old, rollout, mask)
    close(m["rollout_corr/training_ppl"], sum(math.exp(x) for x in train) / len(train))
    close(m["rollout_corr/log_ppl_abs_diff"], sum(abs(a - b) for a, b in zip(train, roll, strict=True)) / len(train))
    close(m["rollout_corr/kl"], sum(r[i][t] - o[i][t] for i, t in toks) / len(toks))
    close(m["rollout_corr/chi2_seq"],
          sum(math.prod(math.exp(o[i][t] - r[i][t]) for t in ts) ** 2 for i, ts in enumerate(rows)) / len(rows) - 1)


# --------------------------------------------------------------------------- config parsing
def test_parsers_accept_verl_forms():
    assert parse_is_threshold(2) == (None, 2.0)
    assert parse_is_threshold("2.0") == (None, 2.0)
    assert parse_is_threshold("0.5_2") == (0.5, 2.0)
    assert parse_rs(None, None) == []
    assert parse_rs("token_k1, seq_sum_k2", "2,0.1") == [("token_k1", 0.5, 2.0), ("seq_sum_k2", None, 0.1)]
    assert parse_rs("seq_mean_k1,seq_max_k3", 1.25) == [("seq_mean_k1", 0.8, 1.25), ("seq_max_k3", None, 1.25)]
    assert parse_rs("token_k1", "0.9_1.5") == [("token_k1", 0.9, 1.5)]
    assert parse_rs(["seq_sum_k3"], [0.3]) == [("seq_sum_k3", None, 0.3)]


@pytest.mark.parametrize("value", [True, None, "", "abc", "0", -1.0, "0_2", "2_1", "0.5_x", "nan", [2.0]])
def test_is_threshold_errors_name_the_key(value):
    with pytest.raises(InputError) as err:
        parse_is_threshold(value)
    msg = str(err.value)
    assert "\n" not in msg and "algorithm.rollout_correction.rollout_is_threshold" in msg
    assert "expected" in msg and f"found {value!r}" in msg


@pytest.mark.parametrize("rs,threshold,key,found", [
    ("token_k4", 2.0, "rollout_rs", "'token_k4'"),
    ("seq_max_k1", 2.0, "rollout_rs", "'seq_max_k1'"),
    (" , ", 2.0, "rollout_rs", "' , '"),
    ("token_k1,token_k1", 2.0, "rollout_rs", "'token_k1,token_k1'"),
    ("token_k1", None, "rollout_rs_threshold", "None"),
    ("token_k1,token_k2,seq_sum_k3", "2,0.1", "rollout_rs_threshold", "'2,0.1'"),
    ("token_k2", "0.1_0.5", "rollout_rs_threshold", "'0.1_0.5'"),
    ("token_k1", "abc", "rollout_rs_threshold", "'abc'"),
    ("token_k1", "2_1", "rollout_rs_threshold", "'2_1'"),
    ("token_k1", 0.5, "rollout_rs_threshold", "'0.5'"),  # lower 1/0.5 = 2 above upper 0.5
    ("seq_sum_k3", -1, "rollout_rs_threshold", "'-1.0'"),
])
def test_rs_errors_name_the_key(rs, threshold, key, found):
    with pytest.raises(InputError) as err:
        parse_rs(rs, threshold)
    msg = str(err.value)
    assert "\n" not in msg and f"algorithm.rollout_correction.{key}:" in msg
    assert "expected" in msg and found in msg


def test_bad_is_level_and_apply_validate_config_first():
    old, rollout, mask = make_batch(seed=13)
    with pytest.raises(InputError, match=r"algorithm\.rollout_correction\.rollout_is: .*found 'geometric'"):
        compute_rollout_correction_weights(old - rollout, mask, "geometric", 2.0)
    with pytest.raises(InputError, match="rollout_is_threshold"):
        apply_rollout_correction(old, rollout, mask, "token", None, None, None)
    with pytest.raises(InputError, match="rollout_rs_threshold"):
        apply_rollout_correction(old, rollout, mask, None, 2.0, "token_k1", None)
