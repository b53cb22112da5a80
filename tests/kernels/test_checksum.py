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


@pytest.fixture
def openmp_threads():
    """At least 2 OpenMP threads in the extension (verl._C shares torch's OpenMP runtime), restored afterwards: the
    CPU kernel goes parallel only from 4 MiB *and* with more than one thread (a 1-thread CI job would otherwise
    test the serial loop twice)."""
    from verl.ops.copy_program import _ext

    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    try:
        threads = _ext().cpu_num_threads()
        assert threads >= 2, f"the extension kept {threads} OpenMP thread(s) after torch.set_num_threads"
        yield threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int64])
def test_the_parallel_path_over_8_mib_matches_the_python_reference(dtype, openmp_threads):
    # 8 MiB (twice the size where the CPU reduction goes parallel), split into tasks of 64 blocks over the threads:
    # the kernel against the definition computed exactly in Python integers, on random words, on the same buffer
    # from an unaligned start with a ragged last block and task, and on the largest words (all bits set).
    size = torch.empty(0, dtype=dtype).element_size()
    numel = (8 << 20) // size
    raw = torch.randint(0, 256, ((numel + 301) * size,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(size)).view(dtype)
    whole, ragged = raw[:numel], raw[1:]
    assert whole.numel() * size == 8 << 20 and ragged.numel() == numel + 300
    for t in (whole, ragged):
        assert checksum(t) % (1 << 64) == reference(t)
    ones = torch.full((numel * size,), 255, dtype=torch.uint8).view(dtype)
    assert checksum(ones) % (1 << 64) == reference(ones)
    # One flipped bit anywhere (here in the last task) changes it.
    flipped = whole.clone()
    flipped.view(torch.uint8)[-5] ^= 1
    assert checksum(flipped) != checksum(whole)


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
