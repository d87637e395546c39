"""Device-spec validation in the server (hpkv.engine.devices) and the one span check every
layout shares (hpkv.common.layout), on the edge values: a layer that ends exactly at the end
of its memory fits, one byte more does not."""

from __future__ import annotations

import os

import pytest

from hpkv.common.layout import pages_fit, pages_span
from hpkv.engine.devices import MAX_LAYERS, validate_cuda, validate_device

STRIDE, PAGE, BLOCKS = 256, 64, 4
SPAN = 3 * STRIDE + PAGE  # the last page ends here


def test_the_span_ends_at_the_last_page_not_at_the_last_stride():
    assert pages_span(BLOCKS, STRIDE, PAGE) == SPAN
    assert pages_span(1, STRIDE, PAGE) == PAGE


@pytest.mark.parametrize(
    ("offset", "size", "fits"),
    [
        (0, SPAN, True),
        (0, SPAN - 1, False),
        (10, SPAN + 10, True),
        (11, SPAN + 10, False),
        (-1, 1 << 40, False),
    ],
)
def test_pages_fit_exactly_up_to_the_end_of_the_memory(offset, size, fits):
    assert pages_fit(offset, size, BLOCKS, STRIDE, PAGE) is fits


def _host_call(path: str, offset: int) -> dict:
    return {
        "regions": [{"path": path}],
        "layer_bases": [[0, offset]],
        "block_stride": STRIDE,
        "page_bytes": PAGE,
        "num_blocks": BLOCKS,
    }


def test_a_host_layer_ending_at_its_region_end_is_accepted_one_byte_further_is_refused(tmp_path):
    region = tmp_path / "kv"
    region.write_bytes(bytes(SPAN + 8))
    uids = {os.geteuid()}
    spec = validate_device(_host_call(str(region), 8), PAGE, uids)
    assert spec["regions"] == [{"path": str(region), "size": SPAN + 8}]
    assert spec["layer_bases"] == [[0, 8]]
    with pytest.raises(ValueError, match="reaches past the region's"):
        validate_device(_host_call(str(region), 9), PAGE, uids)


def _cuda_call(offset: int, alloc_bytes: int, layers: int = 1) -> dict:
    return {
        "layer_bases": [[0, offset]] * layers,
        "block_stride": STRIDE,
        "page_bytes": PAGE,
        "num_blocks": BLOCKS,
        "cuda": {
            "driver": "cuda",
            "uuid": "ab" * 16,
            "mem_handle": "00" * 64,
            "alloc_offset": 0,
            "alloc_bytes": alloc_bytes,
            "events": [],
        },
    }


def test_a_cuda_layer_ending_at_the_buffer_end_is_accepted_one_byte_further_is_refused():
    spec = validate_cuda(_cuda_call(8, SPAN + 8), PAGE, set())
    assert spec["layer_bases"] == [[0, 8]] and spec["cuda"]["alloc_bytes"] == SPAN + 8
    with pytest.raises(ValueError, match="do not fit the"):
        validate_cuda(_cuda_call(9, SPAN + 8), PAGE, set())


def test_host_and_cuda_specs_share_one_layer_limit(tmp_path):
    region = tmp_path / "kv"
    region.write_bytes(bytes(SPAN))
    too_many = MAX_LAYERS + 1
    host = _host_call(str(region), 0) | {"layer_bases": [[0, 0]] * too_many}
    with pytest.raises(ValueError, match=f"1..{MAX_LAYERS} "):
        validate_device(host, too_many * PAGE, {os.geteuid()})
    with pytest.raises(ValueError, match=f"1..{MAX_LAYERS} "):
        validate_cuda(_cuda_call(0, SPAN, layers=too_many), too_many * PAGE, set())
