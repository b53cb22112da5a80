"""The weight sync's bucket checksum (verl._C.checksum, csrc/reshard/checksum*.{h,cpp,cu}) against a pure-Python
reference of its definition: sum_i word_i * (2i + 1) mod 2^64, word_i the element's bits as an unsigned integer."""

import pytest
import torch

from verl.hybrid_engine.weight_sync import checksum

WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def reference(t: torch.Tensor) -> int:
    size = t.element_size()
    mask = (1 << (8 * size)) - 1
    words = t.reshape(-1).view(WORDS[size]).tolist()
    return sum((w & mask) * (2 * i + 1) for i, w in enumerate(words)) % (1 << 64)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.int64])
@pytest.mark.parametrize("numel", [0, 1, 7, 4099])
def test_checksum_matches_its_definition(dtype, numel):
    gen = torch.Generator().manual_seed(numel)
    t = (torch.randn(numel, generator=gen) * 1e3).to(dtype)
    assert checksum(t) % (1 << 64) == reference(t)  # returned as int64, two's complement
    assert -(1 << 63) <= checksum(t) < 1 << 63


def test_threads_split_a_large_buffer_without_changing_the_sum():
    # 8 MiB: above the size where the CPU reduction goes parallel; mod-2^64 addition is order-free.
    t = torch.randn(2 << 20, generator=torch.Generator().manual_seed(0))
    small = torch.cat([t[:1000], t[1000:]])
    assert checksum(t) == checksum(small)
    head = t[:1000]
    assert checksum(head) % (1 << 64) == reference(head)
    want = (checksum(head) + sum(int(w & 0xFFFFFFFF) * (2 * i + 1) for i, w in
                                 enumerate(t[1000:1010].view(torch.int32).tolist(), start=1000))) % (1 << 64)
    assert checksum(t[:1010]) % (1 << 64) == want


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int64])
def test_largest_words_and_block_edges_match_the_definition(dtype):
    # The CPU kernel sums 1- and 2-byte words per 256-element sub-block in 32 bits (exact only while every word is
    # below 2^16) and cuts the buffer into 4096-element blocks, 64 to a thread's task: all bits set is the largest
    # word, and the sizes end just before, on and after each of those edges, from an unaligned start too.
    size = torch.empty(0, dtype=dtype).element_size()
    for numel in (255, 256, 257, 4096 * 3 + 255, 64 * 4096, 64 * 4096 + 300):
        ones = torch.full(((numel + 1) * size,), 255, dtype=torch.uint8).view(dtype)
        assert checksum(ones[:numel]) % (1 << 64) == reference(ones[:numel]), numel
        gen = torch.Generator().manual_seed(numel)
        words = torch.randint(0, 256, ((numel + 1) * size,), dtype=torch.uint8, generator=gen).view(dtype)
        assert checksum(words[1:]) % (1 << 64) == reference(words[1:]), numel
