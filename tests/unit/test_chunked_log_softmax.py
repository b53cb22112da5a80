"""The chunked vocab log-softmax (verl/engine/megatron/vocab_parallel.py) against pure torch: log p(target),
entropy and both gradients equal the naive full-tensor log_softmax to fp32 summation-order tolerance, for any
chunk size, with Megatron's padded vocabulary columns excluded; and it never holds a full-size fp32 temporary."""

import pytest
import torch

from verl.engine.megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy


def _reference(logits, targets, vocab_size):
    log_p = torch.log_softmax(logits[..., :vocab_size].double(), dim=-1)
    lp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return lp, entropy


def _naive(logits, targets, vocab_size):
    log_p = torch.log_softmax(logits[..., :vocab_size], dim=-1)
    return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _within_naive_rounding(ours, naive, ref):
    """ours is as close to the float64 truth as the naive fp32 path is (2x its worst error, + 2 ulps of 1)."""
    worst = (naive.double() - ref).abs().max().item()
    err = (ours.double() - ref).abs().max().item()
    assert err <= 2 * worst + 2 * torch.finfo(torch.float32).eps, (err, worst)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
@pytest.mark.parametrize("padding", [0, 5])
def test_log_probs_entropy_and_gradients_match_pure_torch(chunk, padding):
    torch.manual_seed(0)
    vocab = 301
    logits = (torch.randn(3, 11, vocab + padding) * 4).requires_grad_()
    targets = torch.randint(0, vocab, (3, 11))
    g_lp, g_ent = torch.randn(3, 11), torch.randn(3, 11)

    lp, ent = vocab_parallel_log_probs_and_entropy(logits, targets, vocab, True, chunk_tokens=chunk)
    grad, = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), logits)

    ref_logits = logits.detach().double().requires_grad_()
    ref_lp, ref_ent = _reference(ref_logits, targets, vocab)
    ref_grad, = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), ref_logits)
    # The naive fp32 path (torch's log_softmax over the full tensor, autograd): its rounding sets the tolerance.
    naive_logits = logits.detach().clone().requires_grad_()
    naive_lp, naive_ent = _naive(naive_logits, targets, vocab)
    naive_grad, = torch.autograd.grad((naive_lp * g_lp).sum() + (naive_ent * g_ent).sum(), naive_logits)
    assert lp.dtype == ent.dtype == grad.dtype == torch.float32
    for ours, naive, ref in ((lp, naive_lp, ref_lp), (ent, naive_ent, ref_ent), (grad, naive_grad, ref_grad)):
        _within_naive_rounding(ours, naive, ref)
    if padding:
        assert torch.all(grad[..., vocab:] == 0)

    # Without entropy (the update's usual case): the same log-probs, the gradient of log p alone.
    lp2, none = vocab_parallel_log_probs_and_entropy(logits, targets, vocab, False, chunk_tokens=chunk)
    assert none is None
    grad2, = torch.autograd.grad((lp2 * g_lp).sum(), logits)
    ref_grad2, = torch.autograd.grad((_reference(ref_logits, targets, vocab)[0] * g_lp).sum(), ref_logits)
    torch.testing.assert_close(lp2, lp, rtol=0, atol=0)
    naive_grad2, = torch.autograd.grad((_naive(naive_logits, targets, vocab)[0] * g_lp).sum(), naive_logits)
    _within_naive_rounding(grad2, naive_grad2, ref_grad2)


def test_equals_the_naive_fp32_path_to_summation_order():
    """Against the naive fp32 computation it replaced (shift by the max, exp, sum, gather): equal up to the
    order of fp32 sums over the vocabulary, on a real vocabulary size."""
    torch.manual_seed(1)
    vocab = 49152
    logits = (torch.randn(2, 5, vocab) * 3).requires_grad_()
    targets = torch.randint(0, vocab, (2, 5))
    lp, ent = vocab_parallel_log_probs_and_entropy(logits, targets, vocab, True, chunk_tokens=3)
    naive = torch.log_softmax(logits.detach(), dim=-1)
    naive_lp = naive.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    naive_ent = -(naive.exp() * naive).sum(-1)
    eps = torch.finfo(torch.float32).eps
    tol = 4 * eps * (naive_lp.abs() + 12)  # |log Z| ~ log V + max logit: the sums' rounding, relative to it
    assert torch.all((lp.detach() - naive_lp).abs() <= tol), (lp - naive_lp).abs().max()
    assert torch.all((ent.detach() - naive_ent).abs() <= 64 * eps * 12)


def test_backward_holds_no_full_size_temporary():
    """Chunked means chunked: forward and backward allocate nothing of the logits' size beyond the gradient
    itself (the naive path holds shifted logits and their exp for the whole micro-batch)."""
    torch.manual_seed(2)
    tokens, vocab, chunk = 64, 4096, 8
    logits = torch.randn(tokens, vocab).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    big = []
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.numel() > chunk * vocab:
                    big.append(str(func))
            return out

    with Watch():
        lp, ent = vocab_parallel_log_probs_and_entropy(logits, targets, vocab, True, chunk_tokens=chunk)
        (lp.sum() + ent.sum()).backward()
    # Only the gradient of the logits (one allocation, and views of it) may be full size.
    allocations = [name for name in big if "empty" in name or "zeros" in name or "new_" in name]
    assert len(allocations) == 1, big
    assert not [name for name in big if "exp" in name or "sub" in name or "log_softmax" in name], big


def test_a_slice_of_padding_columns_only_adds_nothing():
    """At TP > 1 a tiny vocabulary leaves a rank's whole slice as Megatron's padding: that rank contributes -inf
    to the max and 0 to the sums, and gets a zero gradient (no indexing into an empty slice)."""
    from verl.engine.megatron.vocab_parallel import _VocabParallelLogProbs

    logits = torch.randn(6, 8).requires_grad_()
    targets = torch.tensor([0, 1, 2, 3, 4, 5])  # all on rank 0's slice (columns 0..7 of a 6-token vocabulary)
    lp, ent = _VocabParallelLogProbs.apply(logits, targets, 6, True, None, 1, 4)  # rank 1: columns 8..15
    assert torch.all(lp == float("inf")) and torch.all(ent.isnan() | ent.isinf())  # log(0): other ranks add theirs
    grad, = torch.autograd.grad(torch.where(lp.isfinite(), lp, 0).sum(), logits)
    assert torch.all(grad == 0)


def test_the_default_chunk_follows_the_vocabulary_width():
    """Tokens per chunk shrink as the vocabulary slice widens, so a chunk's fp32 temporaries stay at CHUNK_ELEMENTS
    whatever the vocabulary (Gemma 3's 262144 columns: 64 tokens; a fixed 1024 held 1 GiB per temporary), and the
    default gives the same values as an explicit chunk."""
    from verl.engine.megatron.vocab_parallel import CHUNK_ELEMENTS, chunk_tokens_for

    assert chunk_tokens_for(262144) * 262144 <= CHUNK_ELEMENTS < (chunk_tokens_for(262144) + 1) * 262144
    assert chunk_tokens_for(49152) > chunk_tokens_for(262144) >= 1 and chunk_tokens_for(CHUNK_ELEMENTS * 2) == 1
    torch.manual_seed(3)
    logits, targets = torch.randn(5, 7, 301), torch.randint(0, 301, (5, 7))
    default = vocab_parallel_log_probs_and_entropy(logits, targets, 301, True)
    explicit = vocab_parallel_log_probs_and_entropy(logits, targets, 301, True, chunk_tokens=4)
    assert torch.equal(default[0], explicit[0]) and torch.equal(default[1], explicit[1])
