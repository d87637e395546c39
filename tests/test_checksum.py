"""CRC32C (native/checksum.c via hpkv.io_workers.checksum): known vectors, a pure-Python
reference, the hardware path against the table path across the 3-way chunk boundaries,
and the crc32c / google-crc32c packages when installed."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpkv.common.native import ffi, lib
from hpkv.io_workers.checksum import crc32c

_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _TABLE.append(_c)


def ref_crc32c(data: bytes, crc: int = 0) -> int:
    """Bytewise reference (reflected Castagnoli polynomial)."""
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


# RFC 3720 (iSCSI) appendix B.4 plus the usual check value.
VECTORS = [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


@pytest.mark.parametrize("data,expect", VECTORS)
def test_known_vectors(data: bytes, expect: int) -> None:
    assert crc32c(data) == expect
    assert lib.hpkv_crc32c_sw(0, data, len(data)) == expect
    assert ref_crc32c(data) == expect


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=3000), st.integers(0, 0xFFFFFFFF))
def test_matches_reference(data: bytes, crc: int) -> None:
    assert crc32c(data, crc) == ref_crc32c(data, crc)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000), st.data())
def test_incremental(data: bytes, draw) -> None:
    cut = draw.draw(st.integers(0, len(data)))
    assert crc32c(data[cut:], crc32c(data[:cut])) == crc32c(data)


def test_hw_equals_table_across_chunk_boundaries() -> None:
    # lengths around the 3x256 and 3x8192 parallel chunks, at every alignment mod 8
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, 3 * 8192 * 3 + 64, dtype=np.uint8)
    lengths = {
        0,
        1,
        7,
        8,
        9,
        767,
        768,
        769,
        775,
        1536,
        24575,
        24576,
        24577,
        24583,
        2 * 24576 + 768 + 5,
        len(buf) - 8,
    }
    for off in range(8):
        for n in lengths:
            view = buf[off : off + n]
            sw = lib.hpkv_crc32c_sw(0, ffi.from_buffer(view), n)
            assert crc32c(view) == sw, (off, n)
    big = buf[3:]
    assert crc32c(big) == lib.hpkv_crc32c_sw(0, ffi.from_buffer(big), big.nbytes)


def test_buffer_types() -> None:
    data = bytes(range(256)) * 5
    expect = ref_crc32c(data)
    assert crc32c(bytearray(data)) == expect
    assert crc32c(memoryview(data)) == expect
    assert crc32c(np.frombuffer(data, np.uint8)) == expect
    assert crc32c(np.frombuffer(data, np.uint32)) == expect  # raw bytes, not elements
    m = mmap.mmap(-1, len(data))
    m.write(data)
    assert crc32c(m) == expect
    m.close()
    with pytest.raises(ValueError, match="C-contiguous"):
        crc32c(np.frombuffer(data, np.uint8)[::2])
    with pytest.raises(ValueError, match="32-bit"):
        crc32c(data, -1)


def test_against_the_crc32c_package() -> None:
    import crc32c as reference  # an independent implementation (test dependency)

    rng = np.random.default_rng(1)
    for n in (0, 1, 100, 4096, 100_003):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert crc32c(data) == reference.crc32c(data)


@pytest.mark.parametrize("n", [0, 1, 7, 65535, 65536, 65537, 3 * 65536 + 24583])
def test_checksum_while_copying_sums_and_copies_every_byte(n) -> None:
    from hpkv.io_workers.checksum import crc32c_copy

    rng = np.random.default_rng(n)
    src = rng.integers(0, 256, n + 5, dtype=np.uint8)[5:]  # unaligned start
    dst = np.zeros(n + 16, np.uint8)
    assert crc32c_copy(dst[3 : 3 + n], src) == crc32c(src)
    np.testing.assert_array_equal(dst[3 : 3 + n], src)
    assert not dst[:3].any() and not dst[3 + n :].any(), "nothing outside the destination is written"
    assert crc32c_copy(dst[3 : 3 + n], src, crc=0x1234) == crc32c(src, 0x1234)


def test_checksum_while_copying_refuses_a_wrong_sized_or_read_only_destination() -> None:
    from hpkv.io_workers.checksum import crc32c_copy

    with pytest.raises(ValueError, match="destination of 9 bytes for a source of 10"):
        crc32c_copy(bytearray(9), bytes(10))
    with pytest.raises((TypeError, BufferError)):
        crc32c_copy(bytes(10), bytes(10))
