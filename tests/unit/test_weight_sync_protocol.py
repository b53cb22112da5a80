"""The cross-pool sync's message protocol (verl.hybrid_engine.weight_sync), every rank in one process.

A queue per (source, destination, tag) stands in for the bridge: a send is enqueued when posted, a receive takes
the oldest message of its queue when waited on, so every sender runs to completion before the receivers. The
shards must arrive bit-exact (dense, delta, forwarded), every message must be consumed, dense headers must be
posted ahead of the previous bucket's payload (the receiver then has them when it gets there), one checksum message
per peer must follow every payload, and a pool that verifies against senders that send no checksums is one error.
"""

import collections
import math

import pytest
import torch

import verl.hybrid_engine.weight_sync as ws
from verl.bench.reshard_reference import random_hf_weights, reference_rollout_shard
from verl.bench.weight_sync import INIT_STD, _layout, adam_steps, training_shard
from verl.hybrid_engine.cross_pool import ROLLOUT, PoolPlacement, plan_cross_pool
from verl.hybrid_engine.rollout_layout import rollout_param_specs
from verl.models.config import ModelConfig

TINY = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
BUCKET_BYTES = 1 << 14  # many buckets: the headers posted ahead cross bucket boundaries


class _Posted:
    def wait(self):
        pass


class _Receive:
    def __init__(self, queues, tensor, key):
        self.queues, self.tensor, self.key = queues, tensor, key

    def wait(self):
        message = self.queues[self.key].popleft()
        assert message.numel() == self.tensor.numel(), (self.key, message.numel(), self.tensor.numel())
        self.tensor.copy_(message.view(self.tensor.shape))


class QueueBridge:
    """One rank's end of the fake bridge; ``log`` lists its sends as (tag, destination) in posting order."""

    def __init__(self, rank, queues):
        self.rank, self.queues, self.log = rank, queues, []

    def isend(self, tensor, dst, tag):
        self.queues[(self.rank, dst, tag)].append(tensor.clone())
        self.log.append((tag, dst))
        return _Posted()

    def irecv(self, tensor, src, tag):
        return _Receive(self.queues, tensor, (src, self.rank, tag))

    isend_control, irecv_control = isend, irecv


def _ranks(train, rollout_tp, replicas, dtype, sender_verify=True, receiver_verify=True):
    config = ModelConfig.from_dict(TINY)
    placement = PoolPlacement(_layout(train), rollout_tp, replicas)
    hf = {n: t * INIT_STD for n, t in random_hf_weights(config, 0).items()}
    queues = collections.defaultdict(collections.deque)
    senders, receivers = {}, {}
    for rank in range(placement.world_size):
        plan = plan_cross_pool(config, placement, rank, BUCKET_BYTES, dtype)
        bridge = QueueBridge(rank, queues)
        role, _, j = placement.role(rank)
        if role == ROLLOUT:
            specs = [(s.name, s.shape) for s in rollout_param_specs(config, rollout_tp, j)]
            receiver = ws.PoolReceiver(plan, specs, bridge, verify=receiver_verify)
            receivers[rank] = (receiver, specs, j, torch.zeros(receiver.numel, dtype=getattr(torch, dtype)))
        else:
            source, offsets = training_shard(config, placement.training, rank, hf, getattr(torch, dtype))
            senders[rank] = (ws.PoolSender(plan, source, offsets, bridge, verify=sender_verify, delta=True), source,
                             offsets)
    return config, placement, hf, queues, senders, receivers


def _sync(senders, receivers, queues, reference) -> tuple[int, int]:
    """One sync of every rank; (bytes sent, dense bytes) over the training ranks."""
    sent = dense = 0
    for sender, source, offsets in senders.values():
        sender.bridge.log.clear()
        stats = sender.send(None if offsets is not None else source)
        sent, dense = sent + stats.bytes, dense + stats.dense_bytes
    for receiver, specs, j, live in receivers.values():
        staging = torch.zeros_like(live)
        receiver.receive(staging, live)
        got = {n: staging[o:o + math.prod(s)].view(s) for (n, s), o in zip(specs, receiver.offsets.values(),
                                                                           strict=True)}
        assert all(torch.equal(got[n], t) for n, t in reference(j).items())
        live.copy_(staging)
    assert not any(queues.values()), {k: len(v) for k, v in queues.items() if v}
    return sent, dense


def _refill(config, placement, hf, senders, dtype):
    for rank, (_, source, offsets) in senders.items():
        fresh, _ = training_shard(config, placement.training, rank, hf, dtype)
        if offsets is not None:
            source.copy_(fresh)
        else:
            for name, t in source.items():
                t.copy_(fresh[name])


@pytest.mark.parametrize("train,rollout_tp,replicas", [
    ({"tp": 2, "pp": 1, "dp": 1}, 1, 2),
    ({"fsdp": 2}, 2, 1),
    ({"tp": 1, "pp": 1, "dp": 1}, 2, 2),  # R*t_g > N_t: replica 1 is fed by replica 0
], ids=["megatron-tp2-to-tp1x2", "fsdp2-to-tp2", "forwarded"])
def test_dense_then_delta_syncs_arrive_bit_exact_with_headers_ahead(train, rollout_tp, replicas):
    dtype = torch.bfloat16
    config, placement, hf, queues, senders, receivers = _ranks(train, rollout_tp, replicas, "bfloat16")
    sent, dense = _sync(senders, receivers, queues, lambda j: reference_rollout_shard(config, hf, rollout_tp, j, dtype))
    assert sent == dense
    for sender, _, _ in senders.values():
        order = {event: n for n, event in enumerate(sender.bridge.log)}
        assert len(order) == len(sender.bridge.log), "one message per (tag, peer) and sync"
        for span_bucket in sender.plan.buckets:
            for span in span_bucket.spans:
                payload = order[(ws._tag(ws._PAYLOAD_TAG, span_bucket.index), span.peer)]
                assert order[(ws._SUMS_TAG, span.peer)] > payload  # one checksum message per peer, after them all
                later = [b for b in sender.plan.buckets if b.index > span_bucket.index][:1]
                for b in later:  # the next bucket's dense headers went before this bucket's payload
                    assert all(order[(ws._tag(ws._HEADER_TAG, b.index), s.peer)] < payload for s in b.spans)
    adam_steps(hf, 1, 1e-6, 0)  # bf16 at lr 1e-6: a few percent of the values change, the spans go as deltas
    _refill(config, placement, hf, senders, dtype)
    sent, dense = _sync(senders, receivers, queues, lambda j: reference_rollout_shard(config, hf, rollout_tp, j, dtype))
    assert 0 < sent < dense


def test_a_pool_that_verifies_refuses_senders_without_checksums_and_one_that_does_not_still_drains_them():
    config, placement, hf, queues, senders, receivers = _ranks({"tp": 2, "pp": 1, "dp": 1}, 2, 1, "float32",
                                                               sender_verify=False)
    for sender, source, offsets in senders.values():
        sender.send(source if offsets is None else None)
    receiver, _, _, live = receivers[2]
    with pytest.raises(ws.WeightSyncError, match=r"^bucket 0 from bridge rank 0 to 2: this rank verifies, but the "
                                                 r"sender sends no checksums \(verify differs between the pools\)$"):
        receiver.receive(torch.zeros_like(live), live)

    config, placement, hf, queues, senders, receivers = _ranks({"tp": 2, "pp": 1, "dp": 1}, 2, 1, "float32",
                                                               receiver_verify=False)
    _sync(senders, receivers, queues,
          lambda j: reference_rollout_shard(config, hf, 2, j, torch.float32))  # every checksum message consumed
