"""verl/ops/cpu_gemm.py: the fp32 CPU linear on oneDNN, forward and backward, against torch's own ``F.linear`` and
its autograd, within the fp32 error bound of each product; a frozen weight gets no gradient; the rollout's and the
trainer's choice of path."""

import pytest
import torch
import torch.nn.functional as F

from verl.ops.cpu_gemm import OneDNNLinear, onednn_available, pick_linear, use_onednn

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")]

U = torch.finfo(torch.float32).eps / 2  # unit roundoff


def _bound(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """Elementwise bound on |two fp32 evaluations of a @ b| apart: each is within gamma_k * (|a| @ |b|) of the
    exact product (any summation order over k terms), gamma_k = k u / (1 - k u)."""
    gamma = k * U / (1 - k * U)
    return 2 * gamma * (a.double().abs() @ b.double().abs()) + 1e-30


def _inputs(seed=0, lead=(3, 5), k=48, n=24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g)
    grad = torch.randn(*lead, n, generator=g)
    return x, w, b, grad


def test_forward_and_backward_equal_torch_within_the_fp32_bound():
    x, w, b, grad = _inputs()
    k, tokens = x.size(-1), x.numel() // x.size(-1)
    got, want = {}, {}
    for out, fn in ((got, lambda x, w, b: OneDNNLinear.apply(x, w, b)), (want, F.linear)):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = fn(xs, ws, bs)
        y.backward(grad)
        out.update(y=y.detach(), x=xs.grad, w=ws.grad, b=bs.grad)
    flat_x, flat_g = x.reshape(-1, k), grad.reshape(-1, w.size(0))
    assert ((got["y"] - want["y"]).abs().reshape(-1, w.size(0))
            <= _bound(flat_x, w.t(), k) + _bound(torch.ones(tokens, 1), b[None].abs(), 1)).all()
    assert ((got["x"] - want["x"]).abs().reshape(-1, k) <= _bound(flat_g, w, w.size(0))).all()
    assert ((got["w"] - want["w"]).abs() <= _bound(flat_g.t(), flat_x, tokens)).all()
    assert ((got["b"] - want["b"]).abs() <= _bound(flat_g.t(), torch.ones(tokens, 1), tokens)[:, 0]).all()
    assert not torch.equal(got["w"], torch.zeros_like(got["w"]))


def test_a_frozen_weight_gets_no_gradient_and_the_input_still_does():
    x, w, _, grad = _inputs(seed=1)
    xs = x.clone().requires_grad_()
    y = OneDNNLinear.apply(xs, w, None)  # w.requires_grad is False, as a LoRA base weight's
    y.backward(grad)
    assert w.grad is None
    want = grad @ w
    assert ((xs.grad - want).abs().reshape(-1, x.size(-1))
            <= _bound(grad.reshape(-1, w.size(0)), w, w.size(0))).all()


def test_the_path_is_onednn_only_for_fp32_on_cpu():
    cpu = torch.device("cpu")
    assert use_onednn(torch.float32, cpu)
    assert not use_onednn(torch.bfloat16, cpu)  # torch's bf16 CPU linear is oneDNN's already
    assert not use_onednn(torch.float32, torch.device("cuda"))
    assert pick_linear(torch.float32, cpu) is not F.linear
    assert pick_linear(torch.bfloat16, cpu) is F.linear


def test_no_tokens_give_empty_outputs_and_a_zero_weight_gradient():
    x = torch.zeros(0, 8, requires_grad=True)  # a rank or micro-batch with nothing to compute
    w = torch.randn(5, 8, requires_grad=True)
    y = OneDNNLinear.apply(x, w, None)
    assert y.shape == (0, 5)
    y.sum().backward()
    assert x.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros(5, 8))


def test_routed_nn_linears_compute_with_their_own_weights_after_a_deepcopy():
    import copy

    from verl.ops.cpu_gemm import use_onednn_for_nn_linears

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 3, bias=False))
    assert use_onednn_for_nn_linears(model) == 2 and use_onednn_for_nn_linears(model) == 0  # once each
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2.0)
    x = torch.randn(5, 8)
    want = F.linear(F.linear(x, twin[0].weight, twin[0].bias), twin[1].weight)
    assert torch.allclose(twin(x), want, rtol=1e-5, atol=1e-6)  # the copy's weights, not the original's
    assert not torch.allclose(model(x), want, rtol=1e-5, atol=1e-6)
