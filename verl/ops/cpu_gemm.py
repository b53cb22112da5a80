"""fp32 linears on CPU through oneDNN's GEMM instead of torch's default BLAS call.

In fp32 on CPU torch's ``F.linear`` / ``matmul`` call the BLAS the wheel was built with (MKL in PyPI's wheels); on
the developers' AMD CPU oneDNN's GEMM (``mkldnn._linear_pointwise``, inductor's CPU linear, the weight as it lies,
no prepacking) is 1.5-2.6x faster on a rollout's and an update's shapes (``verl bench gemm``, results/cpu_gemm/),
equal to fp32 summation-order noise. In bf16 torch already takes oneDNN's path, and on CUDA nothing here applies.

:func:`pick_linear` gives the rollout its forward; :class:`OneDNNLinear` is the same GEMM with its backward (the
input's gradient ``g @ W`` and the weight's ``g^T @ x``, both on oneDNN; strided views go in as they are, which
measured faster than contiguous copies), for the training engines' linears.

``VERL_CPU_GEMM=torch`` keeps torch's default path everywhere (the A/B of results/roofline/).
"""

from __future__ import annotations

import os
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on oneDNN's GEMM (x [..., in], weight [out, in])."""
    if x.size(-1) == 0:  # an empty reduction (a weight gradient over no tokens): oneDNN has no primitive for it
        out = x.new_zeros(*x.shape[:-1], weight.size(0))
        return out if bias is None else out + bias
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def cpu_gemm_library() -> str:
    """``VERL_CPU_GEMM``: ``onednn`` (the default) or ``torch`` (torch's default BLAS path)."""
    from verl.errors import InputError

    library = os.environ.get("VERL_CPU_GEMM", "onednn")
    if library not in ("onednn", "torch"):
        raise InputError(f"VERL_CPU_GEMM: expected 'onednn' or 'torch', found {library!r}")
    return library


def use_onednn(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN's GEMM for this dtype and device: fp32 on a CPU whose torch has it, unless VERL_CPU_GEMM=torch."""
    return (device.type == "cpu" and dtype == torch.float32 and onednn_available()
            and cpu_gemm_library() == "onednn")


def fp32_on_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a routed linear's call takes oneDNN's path: its input and weight fp32 on the CPU (a bf16 or CUDA call
    keeps torch's own)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32


def pick_linear(dtype: torch.dtype, device: torch.device):
    """A forward-only linear: oneDNN's for fp32 on CPU, else ``F.linear``."""
    return onednn_linear if use_onednn(dtype, device) else F.linear


class OneDNNLinear(torch.autograd.Function):
    """``y = x W^T + b`` with its backward on oneDNN; ``allreduce_dgrad`` sums the input's gradient over ``group``
    (a column-parallel linear's backward, as megatron's own linear does it without sequence parallelism). Saves
    what megatron's linear saves (the input and the weight), and computes the weight's gradient only where the
    weight takes one (a frozen LoRA base weight does not)."""

    @staticmethod
    def forward(ctx, x, weight, bias, allreduce_dgrad: bool = False, group=None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.group = group
        return onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        handle = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_linear(grad_output, weight.t())
            if ctx.allreduce_dgrad:  # overlapped with the weight's gradient below
                handle = dist.all_reduce(grad_x, group=ctx.group, async_op=True)
        if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
            flat_grad = grad_output.reshape(-1, grad_output.size(-1))
            if ctx.needs_input_grad[1]:
                grad_weight = onednn_linear(flat_grad.t(), x.reshape(-1, x.size(-1)).t())
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_bias = flat_grad.sum(dim=0)
        if handle is not None:
            handle.wait()
        return grad_x, grad_weight, grad_bias, None, None


def _onednn_nn_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight  # read at call time: FSDP swaps the unsharded parameter in for the forward
    if fp32_on_cpu(x, weight):
        return OneDNNLinear.apply(x, weight, self.bias)
    return F.linear(x, weight, self.bias)


_onednn_nn_linear_forward.onednn = True


def use_onednn_for_nn_linears(model: torch.nn.Module) -> int:
    """Route ``model``'s ``torch.nn.Linear`` modules (a transformers model's projections and head, PEFT's base
    layers and factors) through :class:`OneDNNLinear` when they run in fp32 on CPU; other dtypes and devices
    keep ``F.linear``. Returns how many; none under ``VERL_CPU_GEMM=torch`` or without oneDNN."""
    if not use_onednn(torch.float32, torch.device("cpu")):
        return 0
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and not getattr(module.forward, "onednn", False):
            # a method bound to this instance shadows the class's forward; a deepcopy rebinds it to the copy
            module.forward = types.MethodType(_onednn_nn_linear_forward, module)
            count += 1
    return count
