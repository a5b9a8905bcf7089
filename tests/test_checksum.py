"""The replica checksum (``scan(..., checksum=True)``) against its definition in csrc/common/scan_rules.h,
computed here independently with numpy: the tensor's elements in checksum order (memory order for a
tensor dense in some permutation of its dimensions, logical row-major order otherwise) as one string of
bytes, cut into 32-bit little-endian words, the last one zero-padded; word q adds, modulo 2^32,
murmur3's 32-bit finalizer of the word XOR a salt of q."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nanscan

from conftest import DEVICES, FLOAT_DTYPES, FP8_DTYPES, random_tensor

SALT_LOW, SALT_HIGH = np.uint32(0x9E3779B9), np.uint32(0x85EBCA77)
SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def in_checksum_order(t: torch.Tensor) -> torch.Tensor:
    """The elements in the order the checksum numbers them."""
    by_stride = t.permute(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    if by_stride.is_contiguous():  # non-overlapping and dense: memory order
        return by_stride.reshape(-1)
    return t.reshape(-1)


def reference_checksum(t: torch.Tensor) -> int:
    flat = in_checksum_order(t.detach().cpu()).contiguous()
    data = (
        flat.view(SAME_SIZE_INT[flat.element_size()]).numpy().tobytes()
    )  # C order, little-endian on every platform torch runs
    data += bytes(-len(data) % 4)  # the last word zero-padded
    words = np.frombuffer(data, dtype="<u4")
    index = np.arange(words.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        low = (index & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        salt = low * SALT_LOW + (index >> np.uint64(32)).astype(np.uint32) * SALT_HIGH
        terms = mix(words ^ salt).astype(np.uint64)
    # Summed exactly in 64 bits (no wrap below 2^32 terms), then taken modulo 2^32 as defined.
    return int(terms.sum(dtype=np.uint64)) % (1 << 32)


def checksums(tensors: list[torch.Tensor]) -> list[int]:
    result = nanscan.scan(tensors, checksum=True)
    assert result.checksum is not None
    return result.checksum.cpu().tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + FP8_DTYPES)
def test_checksum_matches_its_definition(device: str, dtype: torch.dtype) -> None:
    base = random_tensor(300_001, torch.float32, device, scale=10.0)
    base[17] = float("nan")
    base[100] = float("inf")
    matrix = random_tensor(96 * 70, torch.float32, device).view(96, 70)
    tensors = [
        base.to(dtype),  # several chunks, several threads
        matrix.to(dtype).t(),  # dense in a permutation: memory order
        matrix.to(dtype)[:, ::3],  # strided: logical order
        matrix.to(dtype)[5:, 1:],  # not dense, offset start
        random_tensor(1, torch.float32, device).to(dtype).view(()),
        torch.empty(0, device=device, dtype=dtype),
        random_tensor(70_001, torch.float32, device).to(dtype)[1:],  # dense view off a 16-byte boundary
    ]
    want = [reference_checksum(t) for t in tensors]
    assert checksums(tensors) == want
    assert all(0 <= c < 1 << 32 for c in want)
    stats = nanscan.scan(tensors)  # the checksum pass reports the same statistics
    with_checksum = nanscan.scan(tensors, checksum=True)
    for name in ("nan_count", "inf_count", "min", "max", "norm"):
        torch.testing.assert_close(getattr(with_checksum, name), getattr(stats, name), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + FP8_DTYPES)
def test_checksum_of_every_short_length_and_layout(dtype: torch.dtype) -> None:
    """The CPU's SIMD lanes, their tail and the strided gather at every length up to a few steps of
    lanes, and around the run length: gcc 12 once miscompiled this loop for 1-byte elements from 256
    elements on (NOTES.md entry 20), which a few fixed sizes did not show for every layout."""
    gen = torch.Generator().manual_seed(3)
    for n in [*range(1, 70), 255, 256, 257, 4095, 4096, 4097, 8193]:
        values = torch.randn(2 * n + 1, generator=gen).to(dtype)
        for t in (values[:n], values[1 : n + 1], values[: 2 * n : 2]):  # dense, dense off alignment, strided
            assert checksums([t]) == [reference_checksum(t)], (n, t.stride(), t.storage_offset())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float8_e4m3fn])
def test_one_bit_and_a_swap_change_the_checksum(device: str, dtype: torch.dtype) -> None:
    """Every bit of every element of a word (elements narrower than 32 bits share words), and a swap of
    two elements in the same word or in different words."""
    t = random_tensor(10_001, torch.float32, device).to(dtype)
    bits = t.element_size() * 8
    before = checksums([t])[0]
    raw = SAME_SIZE_INT[t.element_size()]
    per_word = max(1, 4 // t.element_size())
    for position in range(4320, 4320 + per_word):
        for bit in range(bits):
            flipped = t.clone()
            flipped.view(raw)[position] ^= torch.tensor(1, dtype=raw).bitwise_left_shift(bit).to(device)
            assert checksums([flipped])[0] != before, (position, bit)
    for a, b in ((10, 20), (4320, 4321)):
        swapped = t.clone()
        swapped[[a, b]] = swapped[[b, a]]
        if not torch.equal(swapped.view(raw), t.view(raw)):
            assert checksums([swapped])[0] != before, ("the checksum depends on where each value is", a, b)
    zero, negative_zero = torch.zeros(8, device=device).to(dtype), torch.full((8,), -0.0, device=device).to(dtype)
    assert checksums([zero])[0] != checksums([negative_zero])[0], "-0.0 and 0.0 have different bits"


def test_checksum_is_the_same_for_any_thread_count() -> None:
    t = random_tensor(2_000_003, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = checksums([t])
        torch.set_num_threads(max(2, threads))
        assert checksums([t]) == one
    finally:
        torch.set_num_threads(threads)


def test_checksum_refuses_fp16_range_and_distributed_lists() -> None:
    with pytest.raises(ValueError, match="checksum=True is for plain tensors"):
        nanscan.scan([torch.ones(2)], fp16_range=True, checksum=True)
    with pytest.raises(RuntimeError, match="separate scans"):
        torch.ops.nanscan.scan([torch.ones(2)], True, True)
    assert nanscan.scan([torch.ones(2)]).checksum is None
