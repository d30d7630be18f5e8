"""The hand-written PageBlob framing on both ends of Get equals protobuf's own."""

import os

import pytest

from tiered_cache.server.streams import BatchSizer
from tiered_cache.v1 import cache_pb2 as pb
from tiered_cache.wire.framing import page_blob_message, parse_page_blob


@pytest.mark.parametrize("size", [1, 127, 128, 16383, 16384, 300_000, 2**20 + 7])
def test_page_blob_framing_matches_protobuf(size):
    key, blob, fingerprint = os.urandom(32), os.urandom(size), os.urandom(32)
    assert page_blob_message(key, blob) == pb.PageBlob(key=key, blob=blob).SerializeToString()
    assert page_blob_message(key, blob, fingerprint) == \
        pb.PageBlob(key=key, blob=blob, fingerprint=fingerprint).SerializeToString()
    parsed = parse_page_blob(pb.PageBlob(key=key, blob=blob, fingerprint=fingerprint).SerializeToString())
    assert (parsed.key, parsed.blob, parsed.fingerprint) == (key, blob, fingerprint)
    unknown = pb.PageBlob(key=key, blob=blob).SerializeToString() + b"\x20\x05" + b"\x2a\x02hi"  # fields 4, 5
    assert (parse_page_blob(unknown).key, parse_page_blob(unknown).blob) == (key, blob)  # skipped, as protobuf does


@pytest.mark.parametrize("bad", [b"\x0a\x05ab", b"\x0a", b"\x0b", b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"])
def test_a_malformed_page_blob_is_an_error_not_a_short_blob(bad):
    with pytest.raises(ValueError):
        parse_page_blob(bad)


def test_batch_sizer_holds_about_its_budget_whatever_the_page_size():
    sizer = BatchSizer(8 * 2**20, cap=64)
    assert sizer.count == 1  # nothing seen: one blob tells the size
    sizer.see(2**20)
    assert sizer.count == 8
    sizer.see(64 * 2**20)
    assert sizer.count == 1
    small = BatchSizer(8 * 2**20, cap=64)
    small.see(1024)
    assert small.count == 64
    assert small.full(64, 64 * 1024) and small.full(3, 8 * 2**20) and not small.full(3, 3 * 1024)
