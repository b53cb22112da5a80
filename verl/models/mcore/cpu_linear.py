"""Megatron's tensor-parallel linears on oneDNN's GEMM when they run in fp32 on CPU.

megatron's ColumnParallelLinear and RowParallelLinear (every projection of a block, the MLP's, the output head,
an expert's) compute through ``_forward_impl``: ``torch.matmul`` forward and backward, which in fp32 on CPU is
MKL's GEMM. :func:`use_onednn_linears` gives each such module of a model a ``_forward_impl`` that runs the same
product, its input gradient (with megatron's all-reduce of it over TP for a column-parallel linear) and its weight
gradient on oneDNN (:class:`verl.ops.cpu_gemm.OneDNNLinear`, 1.5-2x per GEMM on the update's shapes, results/cpu_gemm/).
What it does not cover goes to megatron's own function, unchanged: sequence parallelism (its all-gather and
reduce-scatter), gradient-accumulation fusion and deferred weight gradients (GPU features), other dtypes or devices.
``VERL_CPU_GEMM=torch`` leaves every linear as megatron made it.
"""

from __future__ import annotations

import types

import torch

from verl.ops.cpu_gemm import OneDNNLinear, fp32_on_cpu, use_onednn


def _onednn_forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                         sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None,
                         **rest):
    if (sequence_parallel or gradient_accumulation_fusion or grad_output_buffer is not None or rest
            or not fp32_on_cpu(input, weight)):
        return type(self)._forward_impl(self, input=input, weight=weight, bias=bias,
                                        gradient_accumulation_fusion=gradient_accumulation_fusion,
                                        allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                                        grad_output_buffer=grad_output_buffer,
                                        wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group, **rest)
    return OneDNNLinear.apply(input, weight, bias, allreduce_dgrad, tp_group)


_onednn_forward_impl.onednn = True


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Route ``model``'s megatron linears whose weights are fp32 on CPU (or supplied at call time, as a tied output
    layer's) through oneDNN; returns how many."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if not use_onednn(torch.float32, torch.device("cpu")):  # no oneDNN in this torch, or VERL_CPU_GEMM=torch
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        weight = module.weight
        if weight is not None and not use_onednn(weight.dtype, weight.device):
            continue
        if getattr(module._forward_impl, "onednn", False):
            continue
        # A method bound to this instance shadows the class's (megatron calls self._forward_impl(...) by keyword),
        # and falls back to the class's own; a deepcopy rebinds it to the copy.
        module._forward_impl = types.MethodType(_onednn_forward_impl, module)
        count += 1
    return count
