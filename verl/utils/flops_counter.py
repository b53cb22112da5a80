"""Model FLOPs utilisation (``perf/mfu/actor``, ``perf/mfu/critic``) as verl estimates it.

Achieved FLOPs of a PPO update, for a dense Qwen2/Llama (verl's ``FlopsCounter`` formula): per
token ``6 * N`` with N the matmul parameters (q/k/v/o, gate/up/down per layer, embedding and LM
head), plus the attention scores ``6 * sum(seqlen^2) * head_dim * heads * layers``, over the valid
tokens of the batch (attention mask), times the PPO epochs. MFU = that / seconds / (peak FLOP/s of
one device * devices).

The peak is the device's dense bf16 figure, looked up by CUDA device name in :data:`PEAK_FLOPS`
(verl's numbers). A device not in the table has no promised peak: :func:`device_peak_flops` is None
and the caller omits the metric. On CPU there is no promised peak either (verl uses a nominal 448
GFLOP/s; we do not invent one), so CPU runs log no ``perf/mfu/*``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verl.utils.device import is_cuda_available

# Dense bf16 tensor-core peak FLOP/s by device-name substring (verl's _DEVICE_FLOPS entries).
PEAK_FLOPS: dict[str, float] = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
}


def device_peak_flops(device_name: str | None = None, table: Mapping[str, float] = PEAK_FLOPS) -> float | None:
    """The promised FLOP/s of one device named ``device_name`` (default: this rank's CUDA device);
    None on CPU or for a device the table does not list."""
    if device_name is None:
        if not is_cuda_available():
            return None
        import torch

        device_name = torch.cuda.get_device_name()
    for key in sorted(table, key=len, reverse=True):  # the most specific name first
        if key in device_name:
            return table[key]
    return None


def training_flops(config: Any, seqlens: Sequence[int]) -> float:
    """Forward + backward FLOPs of one pass over sequences of ``seqlens`` valid tokens (verl's
    ``_estimate_qwen2_flops`` without the division by time). ``config``: hidden_size, intermediate_size,
    num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, vocab_size."""
    hidden, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q_size, kv_size = heads * head_dim, config.num_key_value_heads * head_dim
    mlp = 3 * hidden * config.intermediate_size            # gate, up, down
    attn_linear = hidden * (q_size + 2 * kv_size + q_size)  # q, k, v, o
    embed_and_head = 2 * config.vocab_size * hidden
    dense_params = (mlp + attn_linear) * layers + embed_and_head
    tokens = sum(int(s) for s in seqlens)
    attention = 6 * sum(int(s) ** 2 for s in seqlens) * head_dim * heads * layers
    return 6.0 * dense_params * tokens + attention


def mfu(flops: float, seconds: float, n_devices: int, peak_flops: float | None) -> float | None:
    """Achieved / promised FLOP/s; None when there is no promised peak or no time."""
    if peak_flops is None or peak_flops <= 0 or seconds <= 0 or n_devices <= 0:
        return None
    return flops / seconds / (peak_flops * n_devices)
