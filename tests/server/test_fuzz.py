"""Hostile input: bytes no honest client sends, fed to the store server, the blob decoder and the index.

Each must refuse cleanly (a gRPC status a client can act on, a BlobError, a ValueError or
TypeError), keep serving, and never hand out bytes other than those validly stored for a key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from conftest import examples
from google.protobuf.message import DecodeError
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from service_helpers import FINGERPRINT, SPEC, checksummed, make_items

from tiered_cache.client.store_client import StoreClient
from tiered_cache.index.keys import PageKeyer
from tiered_cache.index.radix import RadixTree
from tiered_cache.model.spec import KVSpec
from tiered_cache.server.config import ServerConfig
from tiered_cache.server.process import StoreProcess
from tiered_cache.v1 import cache_pb2 as pb
from tiered_cache.wire import codec
from tiered_cache.wire.codec import BlobError, Codec, encode_page
from tiered_cache.wire.framing import _varint

# --- the store server ------------------------------------------------------------------------------
MAX_PAGE = 64 * 1024
MAX_MESSAGE = ServerConfig(max_page_bytes=MAX_PAGE).max_message_bytes  # gRPC refuses longer messages
SERVICE = "/tiered_cache.v1.KVCache/"
CALLABLE = {"Lookup", "Get", "Put", "Stats"}
S = grpc.StatusCode
# What a hostile call may get back. Never INTERNAL or UNKNOWN: those mean the server did not understand
# its own failure (an unhandled exception, or grpc's bare answer to a request it could not parse).
ALLOWED = {S.OK, S.INVALID_ARGUMENT, S.RESOURCE_EXHAUSTED, S.UNIMPLEMENTED, S.CANCELLED, S.FAILED_PRECONDITION}

KNOWN = dict(make_items(12, start=5000))  # put before any fuzzing: must be served byte for byte
SPARE = dict(make_items(12, start=6000, seed=1))  # valid pages a fuzzed Put may store
TRUTH = {**KNOWN, **SPARE}
# Validly encoded pages of other content under known keys: the server cannot tell them from the
# real page, but it holds the real one already, so they must be counted as held, never replace it.
FORGED = {k: encode_page(torch.full(SPEC.staging_shape(1)[1:], float(i + 1)).half(), SPEC, k)
          for i, k in enumerate(KNOWN)}


@dataclass
class FuzzStore:
    server: StoreProcess
    client: StoreClient
    channel: grpc.Channel
    rss_start_kib: int

    def rss_kib(self) -> int:
        assert self.server.proc is not None
        with open(f"/proc/{self.server.proc.pid}/status") as f:
            line = next(line for line in f if line.startswith("VmRSS:"))
        return int(line.split()[1])

    def assert_serving(self) -> None:
        assert self.server.proc is not None and self.server.proc.poll() is None, "the store server died"
        assert self.client.health(timeout_s=10) == "SERVING"

    def assert_intact(self) -> None:
        """Every known page is held and served as put; a spare page, if held, is served as put."""
        self.assert_serving()
        keys = list(TRUTH)
        reply = self.client.lookup(list(KNOWN))
        assert reply.leading == len(KNOWN), "a fuzzed call made the store drop a known page"
        got = [(g.key, bytes(g.blob)) for g in self.client.get(keys)]
        assert [k for k, _ in got if k in KNOWN] == list(KNOWN)
        for key, blob in got:
            assert blob == TRUTH[key], f"page {key.hex()[:16]} is served with other bytes than were put"
        grown = self.rss_kib() - self.rss_start_kib
        assert grown < 200 * 1024, f"the server's RSS grew by {grown / 1024:.0f} MiB (its RAM tier is 8 MiB)"


@pytest.fixture(scope="module")
def store():
    with StoreProcess(["--no-disk", "--max-page", "64KiB", "--ram", "8MiB"]) as server:
        channel = grpc.insecure_channel(server.address)
        with StoreClient(server.address) as client:
            ack = client.put(list(KNOWN.items()), FINGERPRINT)
            assert (ack.stored, len(ack.refused)) == (len(KNOWN), 0)
            fuzz = FuzzStore(server, client, channel, 0)
            fuzz.rss_start_kib = fuzz.rss_kib()
            yield fuzz
            fuzz.assert_intact()
        channel.close()
    # A handler that failed inside but still sent an allowed status would have logged it here.
    logged = [line for line in server.output if "Traceback" in line or "Error" in line or "Exception" in line]
    assert not logged, "the store server logged errors:\n" + "\n".join(server.output)


def call_status(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, Any]:
    """(status, reply or details) of one raw call."""
    try:
        return S.OK, fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


# --- protobuf wire bytes, built by hand -------------------------------------------------------------
varint = _varint  # the encoder our hand framing uses (wire/framing.py)


@st.composite
def wire_fields(draw: st.DrawFn) -> bytes:
    """0-5 protobuf fields of any wire type, numbered 0-4: a varint where bytes are expected, bytes
    where nothing is, groups, fixed-width values, lengths that run past the end, and so on."""
    out = b""
    for _ in range(draw(st.integers(0, 5))):
        number, wire = draw(st.integers(0, 4)), draw(st.integers(0, 7))
        tag = varint(number << 3 | wire)
        if wire == 0:
            body = varint(draw(st.integers(0, 2**64 - 1)))
        elif wire in (1, 5):
            body = draw(st.binary(min_size=8 if wire == 1 else 4, max_size=8 if wire == 1 else 4))
        elif wire == 2:
            data = draw(st.binary(max_size=48))
            body = varint(draw(st.sampled_from([len(data), len(data) + 1, 2**31, 2**63]))) + data
        elif wire == 3:  # a group, ended or not
            body = draw(st.binary(max_size=8)) + draw(st.sampled_from([varint(number << 3 | 4), b""]))
        else:
            body = draw(st.binary(max_size=8))
        out += tag + body
    return out


@st.composite
def mutated(draw: st.DrawFn, messages: st.SearchStrategy[bytes]) -> bytes:
    """A message with bits flipped, cut short, extended, or with bytes inserted or deleted."""
    data = bytearray(draw(messages))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "extend", "insert", "delete"]))
        if kind == "flip" and data:
            bit = draw(st.integers(0, 8 * len(data) - 1))
            data[bit // 8] ^= 1 << bit % 8
        elif kind == "truncate":
            del data[draw(st.integers(0, len(data))):]
        elif kind == "extend":
            data += draw(st.binary(min_size=1, max_size=40))
        elif kind == "insert":
            at = draw(st.integers(0, len(data)))
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif data:
            at = draw(st.integers(0, len(data) - 1))
            del data[at:at + draw(st.integers(1, 8))]
    return bytes(data)


any_key = st.one_of(st.sampled_from(list(KNOWN)), st.sampled_from(list(SPARE)), st.binary(min_size=32, max_size=32),
                    st.binary(max_size=40))  # the last: mostly keys of the wrong length
fingerprints = st.one_of(st.just(b""), st.just(FINGERPRINT), st.binary(min_size=32, max_size=32),
                         st.binary(max_size=40))
# Over the message limit: n keys of 32 bytes (34 with framing) in one request.
too_many_keys = st.integers(MAX_MESSAGE // 34 + 1, MAX_MESSAGE // 34 + 200)


def rarely(strategy: st.SearchStrategy[Any], otherwise: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # Messages over gRPC's bound are refused in its transport, and each such call takes 0.1-0.3 s
    # there (other clients are not slowed): one input in 25 is enough to cover them. (Not 0: hypothesis
    # draws the ends of a range far more often than the middle.)
    return st.integers(0, 24).flatmap(lambda i: strategy if i == 12 else otherwise)


def hostile(valid: st.SearchStrategy[bytes], oversized: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return rarely(oversized, st.one_of(st.binary(max_size=300), valid, mutated(valid), wire_fields()))


lookup_requests = hostile(
    st.lists(any_key, max_size=8).map(lambda keys: pb.LookupRequest(keys=keys).SerializeToString()),
    too_many_keys.map(lambda n: pb.LookupRequest(keys=[bytes(32)] * n).SerializeToString()))
get_requests = hostile(
    st.builds(lambda keys, fp: pb.GetRequest(keys=keys, fingerprint=fp).SerializeToString(),
              st.lists(any_key, max_size=8), fingerprints),
    too_many_keys.map(lambda n: pb.GetRequest(keys=[bytes(32)] * n, fingerprint=FINGERPRINT).SerializeToString()))
stats_requests = hostile(st.just(pb.StatsRequest().SerializeToString()),
                         st.integers(MAX_MESSAGE + 1, MAX_MESSAGE + 999).map(lambda n: b"\x0a" + varint(n) + bytes(n)))


def parsed(message_cls: Any, data: bytes) -> Any:
    """The message protobuf itself reads from `data`, or None where it reads none."""
    try:
        return message_cls.FromString(data)
    except DecodeError:
        return None


def expected_refusal(message_cls: Any, data: bytes) -> grpc.StatusCode | None:
    """The status a request must get for its form alone (None: OK, if nothing else is wrong)."""
    if len(data) > MAX_MESSAGE:
        return S.RESOURCE_EXHAUSTED
    request = parsed(message_cls, data)
    if request is None or any(len(k) != 32 for k in getattr(request, "keys", ())):
        return S.INVALID_ARGUMENT
    if len(getattr(request, "fingerprint", b"")) not in (0, 32):
        return S.INVALID_ARGUMENT
    return None


@settings(max_examples=examples(200), deadline=None)
@given(data=lookup_requests)
def test_lookup_survives_hostile_requests(store, data):
    lookup = store.channel.unary_unary(SERVICE + "Lookup")
    code, reply = call_status(lambda: lookup(data, timeout=10))
    assert code in ALLOWED, f"{code}: {reply}"
    assert code == (expected_refusal(pb.LookupRequest, data) or S.OK), reply
    if code == S.OK:
        keys = list(pb.LookupRequest.FromString(data).keys)
        tiers = list(pb.LookupResponse.FromString(reply).tiers)
        assert len(tiers) == len(keys)
        for key, tier in zip(keys, tiers, strict=True):
            if key in KNOWN:
                assert tier == pb.TIER_RAM
            elif key not in SPARE:
                assert tier == pb.TIER_NONE, "the store holds a page nobody validly put"
        reply_leading = pb.LookupResponse.FromString(reply).leading
        assert reply_leading == next((i for i, t in enumerate(tiers) if t == pb.TIER_NONE), len(tiers))
    store.assert_intact()


@settings(max_examples=examples(200), deadline=None)
@given(data=get_requests)
def test_get_survives_hostile_requests_and_serves_only_what_was_put(store, data):
    get = store.channel.unary_stream(SERVICE + "Get")
    code, reply = call_status(lambda: list(get(data, timeout=10)))
    assert code in ALLOWED, f"{code}: {reply}"
    assert code == (expected_refusal(pb.GetRequest, data) or S.OK), reply
    if code == S.OK:
        request = pb.GetRequest.FromString(data)
        got = [pb.PageBlob.FromString(m) for m in reply]
        for item in got:
            assert item.blob == TRUTH.get(item.key), "Get served bytes nobody validly put under that key"
        fp_ok = request.fingerprint in (b"", FINGERPRINT)
        returned = {item.key for item in got}
        # In request order: every known key, and a spare key only where the store holds it.
        expected = [k for k in request.keys if fp_ok and (k in KNOWN or (k in SPARE and k in returned))]
        assert [item.key for item in got] == expected
    store.assert_intact()


@settings(max_examples=examples(75), deadline=None)
@given(data=stats_requests)
def test_stats_survives_hostile_requests(store, data):
    stats = store.channel.unary_unary(SERVICE + "Stats")
    code, reply = call_status(lambda: stats(data, timeout=10))
    assert code in ALLOWED, f"{code}: {reply}"
    assert code == (expected_refusal(pb.StatsRequest, data) or S.OK), reply
    if code == S.OK:
        assert pb.StatsResponse.FromString(reply).server.requests > 0
    store.assert_intact()


# --- Put streams ------------------------------------------------------------------------------------
def page_blob(key: bytes, blob: bytes, fingerprint: bytes = b"") -> bytes:
    return pb.PageBlob(key=key, blob=blob, fingerprint=fingerprint).SerializeToString()


truth_items = st.sampled_from(list(TRUTH.items()))
blob_changes = st.sampled_from(["flip", "truncate", "extend"])


@st.composite
def changed_blob(draw: st.DrawFn) -> bytes:
    key, blob = draw(truth_items)
    change, data = draw(blob_changes), bytearray(blob)
    if change == "flip":
        bit = draw(st.integers(0, 8 * len(data) - 1))
        data[bit // 8] ^= 1 << bit % 8
    elif change == "truncate":
        del data[draw(st.integers(0, len(data) - 1)):]
    else:
        data += draw(st.binary(min_size=1, max_size=16))
    return page_blob(key, bytes(data), draw(fingerprints))


put_items = st.one_of(
    st.builds(lambda kv, fp: page_blob(*kv, fp), truth_items, fingerprints),  # valid, any fingerprint
    st.builds(lambda k, kv: page_blob(k, kv[1]), any_key, truth_items),  # a blob under another key
    st.sampled_from(list(FORGED.items())).map(lambda kv: page_blob(*kv)),  # other content, known key
    changed_blob(),
    mutated(truth_items.map(lambda kv: page_blob(*kv))),  # the message itself damaged
    st.binary(max_size=300),
    wire_fields(),
    st.integers(MAX_PAGE + 1, MAX_MESSAGE - 1024).map(lambda n: page_blob(bytes(32), bytes(n))),  # TOO_LARGE
)
oversized_item = st.integers(MAX_MESSAGE + 1, MAX_MESSAGE + 999).map(lambda n: page_blob(bytes(32), bytes(n)))


@dataclass
class PutStream:
    """Stream `items` and end as `ending` says: `close` (a normal end), `raise` (the client's
    iterator fails after `cut` items) or `cancel` (the client cancels after `cut` items)."""

    items: list[bytes]
    ending: str
    cut: int
    consumed: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def __iter__(self) -> Iterator[bytes]:
        for i, item in enumerate(self.items):
            if self.ending != "close" and i == self.cut:
                break
            yield item
        if self.ending == "raise":
            raise RuntimeError("the client's page source failed mid-stream")
        if self.ending == "cancel":
            self.consumed.set()
            self.release.wait(10)


@st.composite
def put_streams(draw: st.DrawFn) -> PutStream:
    # Up to 150 valid pages first, so that the batch boundary (64 items) falls inside the stream.
    head = draw(st.lists(truth_items.map(lambda kv: page_blob(*kv)), max_size=150)) if draw(st.booleans()) else []
    items = head + draw(st.lists(put_items, max_size=8))
    over = draw(rarely(st.just(True), st.just(False)))
    if over:
        items.insert(draw(st.integers(0, len(items))), draw(oversized_item))
    ending = draw(st.sampled_from(["close", "close", "raise", "cancel"]))
    return PutStream(items, ending, draw(st.integers(0, len(items))))


@settings(max_examples=examples(150), deadline=None)
@given(stream=put_streams())
def test_put_survives_hostile_streams(store, stream):
    put = store.channel.stream_unary(SERVICE + "Put")
    future = put.future(iter(stream), timeout=20)
    future.add_done_callback(lambda _: stream.consumed.set())  # the server may answer before the cut
    cancelled = False
    if stream.ending == "cancel":
        stream.consumed.wait(10)
        cancelled = future.cancel()  # False when the server had answered already
        stream.release.set()
    code, reply = (S.CANCELLED, None) if cancelled else call_status(future.result)
    if stream.ending == "raise" and code == S.UNKNOWN:
        # The client's own status for its failed iterator; the server only saw the call cancelled.
        assert reply == "Exception iterating requests!"
    else:
        assert code in ALLOWED, f"{code}: {reply}"
    sent = stream.items if stream.ending == "close" else stream.items[:stream.cut]
    if code == S.OK:
        ack = pb.PutResponse.FromString(reply)
        assert ack.stored + ack.already_held + len(ack.refused) == len(sent), "a page went unaccounted for"
        assert all(r.reason != pb.REFUSAL_UNSPECIFIED and r.message for r in ack.refused)
    if any(len(item) > MAX_MESSAGE for item in sent) and stream.ending == "close":
        assert code in (S.RESOURCE_EXHAUSTED, S.INVALID_ARGUMENT)  # the latter: a malformed item came first
    store.assert_intact()


def test_a_forged_page_under_a_held_key_never_replaces_it(store):
    items = [(k, FORGED[k]) for k in KNOWN]
    ack = store.client.put(items)
    assert (ack.stored, ack.already_held, len(ack.refused)) == (0, len(KNOWN), 0)
    wrong_fp = store.client.put(list(SPARE.items())[:2], fingerprint=bytes(32))
    assert [r.reason for r in wrong_fp.refused] == [pb.FINGERPRINT_MISMATCH] * 2 and wrong_fp.stored == 0
    assert list(store.client.get(list(KNOWN), fingerprint=bytes(32))) == []  # a wrong fingerprint: nothing
    store.assert_intact()


method_names = st.one_of(st.from_regex(r"[A-Za-z0-9_]{0,24}", fullmatch=True),
                         st.sampled_from(["lookup", "GET", "Put ", "Stats/", "Health", "Lookup/Lookup"]))
paths = st.one_of(method_names.map(lambda m: SERVICE + m),
                  st.from_regex(r"/[A-Za-z0-9_.]{1,30}/[A-Za-z0-9_]{1,24}", fullmatch=True))


@settings(max_examples=examples(100), deadline=None)
@given(path=paths, shape=st.sampled_from(["unary_unary", "unary_stream", "stream_unary", "stream_stream"]),
       messages=st.lists(st.binary(max_size=64), min_size=1, max_size=3))
def test_unknown_methods_and_wrong_call_shapes(store, path, shape, messages):
    """An unknown method is UNIMPLEMENTED whatever its shape; a known one called in the wrong shape
    (with at least one message: grpc's asyncio server never answers a unary call sent none, so
    only the client's deadline ends it) gets a status from the allowed set."""
    method = getattr(store.channel, shape)(path)
    if shape.startswith("unary"):
        request: Any = messages[0]
    else:
        request = iter(messages)
    code, reply = call_status(lambda: list(method(request, timeout=10)) if shape.endswith("stream")
                              else method(request, timeout=10))
    assert code in ALLOWED, f"{path} ({shape}): {code}: {reply}"
    if path.removeprefix(SERVICE) not in CALLABLE:
        assert code == S.UNIMPLEMENTED, f"{path}: {code}"
    store.assert_intact()


def test_store_memory_stays_bounded_under_repeated_oversized_and_malformed_calls(store):
    """625 refused calls carrying about 115 MiB: 300 Puts of two blobs over the page limit (each
    parsed and checked by the handler), 300 Puts of a malformed item, 25 Lookups over gRPC's
    bound. A server that kept what it refused would grow by about as much, past the 64 MiB bound."""
    lookup = store.channel.unary_unary(SERVICE + "Lookup")
    put = store.channel.stream_unary(SERVICE + "Put")
    big_lookup = pb.LookupRequest(keys=[bytes(32)] * (MAX_MESSAGE // 34 + 1)).SerializeToString()
    not_a_blob = page_blob(bytes(32), bytes(MAX_MESSAGE - 1024))  # within gRPC's bound, over the page limit
    malformed = b"\x0a\x20" + bytes(32) + b"\x12" + varint(MAX_MESSAGE - 1024) + bytes(MAX_MESSAGE - 1100)
    before = store.rss_kib()
    codes: dict[grpc.StatusCode, int] = {}
    for i in range(300):
        calls = [lambda: put(iter([not_a_blob, not_a_blob]), timeout=10), lambda: put(iter([malformed]), timeout=10)]
        if i % 12 == 0:
            calls.append(lambda: lookup(big_lookup, timeout=10))
        for call in calls:
            code, _ = call_status(call)
            codes[code] = codes.get(code, 0) + 1
            store.assert_serving()
    assert codes == {S.OK: 300, S.INVALID_ARGUMENT: 300, S.RESOURCE_EXHAUSTED: 25}
    grown = store.rss_kib() - before
    assert grown < 64 * 1024, f"RSS grew by {grown / 1024:.0f} MiB over 115 MiB of refused calls"
    store.assert_intact()


# --- the page blob ----------------------------------------------------------------------------------
BLOB_SPEC = KVSpec("fuzz", 2, 2, 16, page_size=4)  # 1 KiB pages
BLOB_KEY = PageKeyer(BLOB_SPEC).keys(list(range(4)))[0]
OTHER_KEY = PageKeyer(BLOB_SPEC).keys(list(range(1, 5)))[0]


def _blobs() -> dict[Codec, bytes]:
    # Small integers: a page that lz4 shrinks, so lz4 and lz4-shuffle are really used.
    page = (torch.arange(BLOB_SPEC.bytes_per_page // 2) % 7).half().reshape(BLOB_SPEC.staging_shape(1)[1:])
    blobs = {c: encode_page(page, BLOB_SPEC, BLOB_KEY, c) for c in Codec}
    for c, blob in blobs.items():
        assert codec.read_header(blob).codec is c, f"{c.value} fell back to raw: the test would not cover it"
    return blobs


BLOBS = _blobs()
codecs = st.sampled_from(list(Codec))


def assert_refused(blob: bytes, key: bytes = BLOB_KEY) -> None:
    """Every reader refuses `blob` with BlobError (pytest.raises lets any other exception through)."""
    with pytest.raises(BlobError):
        codec.read_header(blob)
    with pytest.raises(BlobError):
        codec.verify_blob(blob, key)
    with pytest.raises(BlobError):
        codec.decode_page(blob, BLOB_SPEC, key)
    with pytest.raises(BlobError):
        codec.page_view(blob, BLOB_SPEC, key)


def test_every_truncation_of_every_codec_is_refused():
    for blob in BLOBS.values():
        for n in range(len(blob)):
            assert_refused(blob[:n])
            if n >= codec.HEADER_BYTES:  # what a store reads first to drop a short file unread
                assert codec.expected_blob_size(blob[:n]) == len(blob) != n


@settings(max_examples=examples(150))
@given(c=codecs, data=st.data())
def test_bit_flips_are_refused(c, data):
    blob = bytearray(BLOBS[c])
    # At most 3 distinct bits: CRC-32C detects every such change in a blob this size (Hamming distance 4+).
    for bit in data.draw(st.sets(st.integers(0, 8 * len(blob) - 1), min_size=1, max_size=3)):
        blob[bit // 8] ^= 1 << bit % 8
    assert_refused(bytes(blob))


@settings(max_examples=examples(150))
@given(c=codecs, extra=st.binary(min_size=1, max_size=64), at=st.integers(0, 10**6),
       change=st.sampled_from(["append", "insert", "delete"]))
def test_appended_inserted_and_deleted_bytes_are_refused(c, extra, at, change):
    blob = BLOBS[c]
    at %= len(blob)
    if change == "append":
        changed = blob + extra
    elif change == "insert":
        changed = blob[:at] + extra + blob[at:]
    else:
        changed = blob[:at] + blob[at + len(extra):]
    assert_refused(changed)


@settings(max_examples=examples(150))
@given(prefix=st.sampled_from([b"", codec.MAGIC, codec.MAGIC + bytes([codec.VERSION])]), rest=st.binary(max_size=1200))
def test_random_bytes_are_refused(prefix, rest):
    assert_refused(prefix + rest)


FP8_SPEC = BLOB_SPEC.with_options(dtype="fp8")
INT8_PAYLOAD = 32 * 2 + 32 * 16  # 32 rows of 16 (a scale each) for both specs: 1 KiB fp16, 512 B fp8


# What each codec's honest blob decodes to: a hostile blob that happens to be byte for byte an honest
# one must give exactly this page, and a raw page of zeros with every field right gives zeros.
PAGES = {blob: codec.decode_page(blob, BLOB_SPEC, BLOB_KEY).tobytes() for blob in BLOBS.values()}


def _honest_raw(spec: KVSpec) -> bytes:
    return checksummed(spec, Codec.RAW.wire_id, codec._DTYPES.index(spec.dtype), spec.staging_shape(1)[1:],
                       spec.bytes_per_page, bytes(spec.bytes_per_page), BLOB_KEY)


PAGES.update({_honest_raw(spec): bytes(spec.bytes_per_page) for spec in (BLOB_SPEC, FP8_SPEC)})


@st.composite
def checksummed_headers(draw: st.DrawFn) -> tuple[KVSpec, bytes]:
    """Blobs whose header fields are hostile but consistent in length, with a correct checksum: what
    a buggy or malicious writer could produce. Each field is the right one half the time (the codec
    id too: the one its payload was encoded with), so that the reader gets past the early checks to
    the codecs, and some blobs come out honest."""
    spec = draw(st.sampled_from([BLOB_SPEC, FP8_SPEC]))

    def right_or(value: Any, wrong: st.SearchStrategy[Any]) -> Any:
        return value if draw(st.booleans()) else draw(wrong)

    payload_codec = draw(codecs)
    payload = draw(st.one_of(st.binary(max_size=1500), st.binary(min_size=INT8_PAYLOAD, max_size=INT8_PAYLOAD),
                             st.just(bytes(spec.bytes_per_page)), st.just(BLOBS[payload_codec][96 + 20:-4])))
    if payload == bytes(spec.bytes_per_page):
        payload_codec = Codec.RAW
    codec_id = right_or(payload_codec.wire_id, st.integers(0, 5))
    dtype_id = right_or(codec._DTYPES.index(spec.dtype), st.integers(0, 5))
    shape = right_or(spec.staging_shape(1)[1:], st.lists(st.integers(0, 2**32 - 1), max_size=8).map(tuple))
    raw_len = right_or(spec.bytes_per_page, st.sampled_from([0, 1, 2**64 - 1, BLOB_SPEC.bytes_per_page]))
    return spec, checksummed(spec, codec_id, dtype_id, shape, raw_len, payload, BLOB_KEY)


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # int8 scales of NaN or inf: valid, if odd
@settings(max_examples=examples(200))
@given(case=checksummed_headers())
# Always tried first, whatever the random draws: honest blobs, so the "one page" branch is taken.
@example(case=(FP8_SPEC, _honest_raw(FP8_SPEC)))
@example(case=(BLOB_SPEC, BLOBS[Codec.RAW]))
@example(case=(BLOB_SPEC, BLOBS[Codec.LZ4]))
@example(case=(BLOB_SPEC, BLOBS[Codec.LZ4_SHUFFLE]))
@example(case=(BLOB_SPEC, BLOBS[Codec.INT8]))
@example(case=(BLOB_SPEC, BLOBS[Codec.BLOSC2]))
def test_checksummed_hostile_headers_are_refused_or_give_one_page(case):
    """Each reader either refuses the blob with a BlobError that names its fault, or gives one
    page; both readers give the same answer, and an honest blob gives its page exactly."""
    spec, blob = case
    answers = []
    for read in (codec.decode_page, codec.page_view):
        try:
            out = read(blob, spec, BLOB_KEY)
        except BlobError as refused:
            assert isinstance(refused.fault, codec.BlobFault) and str(refused)
            answers.append(refused.fault)
            continue
        assert out.dtype == np.uint8 and out.shape == (spec.bytes_per_page,)
        answers.append(out.tobytes())
    event("refused" if isinstance(answers[0], codec.BlobFault) else "one page")
    assert answers[0] == answers[1], "decode_page and page_view disagree on a blob"
    if blob in PAGES:
        assert answers[0] == PAGES[blob], "an honest blob was refused or gave another page"


def test_an_int8_blob_for_an_fp8_model_is_a_blob_error():
    """int8 encodes only fp16, bf16 and fp32 pages; a well-formed int8 blob that claims fp8 KV
    once escaped as numpy's broadcast ValueError, past every `except BlobError` (a crash, not a miss)."""
    blob = checksummed(FP8_SPEC, Codec.INT8.wire_id, codec._DTYPES.index(FP8_SPEC.dtype),
                       FP8_SPEC.staging_shape(1)[1:], FP8_SPEC.bytes_per_page, bytes(INT8_PAYLOAD), BLOB_KEY)
    codec.verify_blob(blob, BLOB_KEY)  # well-formed: only decoding can refuse it
    for read in (codec.decode_page, codec.page_view):
        with pytest.raises(BlobError, match="int8"):
            read(blob, FP8_SPEC, BLOB_KEY)


def test_a_valid_blob_is_refused_for_another_key_or_model():
    other_model = BLOB_SPEC.with_options(model_id="other")
    for blob in BLOBS.values():
        for read in (lambda b: codec.verify_blob(b, OTHER_KEY), lambda b: codec.decode_page(b, BLOB_SPEC, OTHER_KEY)):
            with pytest.raises(BlobError) as info:
                read(blob)
            assert info.value.fault is codec.BlobFault.WRONG_KEY
        with pytest.raises(BlobError) as info:
            codec.decode_page(blob, other_model, BLOB_KEY)
        assert info.value.fault is codec.BlobFault.WRONG_FINGERPRINT
        codec.verify_blob(blob, BLOB_KEY)  # the unchanged blob, for its own key, is fine


# --- page keys and the radix tree --------------------------------------------------------------------
PAGE = 16
KEYER = PageKeyer(KVSpec("fuzz", 1, 1, 1, page_size=PAGE))
INT32_MAX = 2**31 - 1


@pytest.mark.parametrize("tokens", [
    [-1], [0, -5], [-(2**31)], [2**31], [2**32], [2**32 + 7], [2**63 - 1], [2**64 - 1], [2**70], [-(2**70)],
    np.array([2**31], dtype=np.int64), np.array([2**32 + 1], dtype=np.int64), np.array([-1], dtype=np.int32),
    np.array([2**64 - 1], dtype=np.uint64), np.array([2**31], dtype=np.uint32),
    torch.tensor([2**31]), torch.tensor([-1]), torch.tensor([2**40, 1]),
    [1.0], np.array([1.5]), [True, False], torch.tensor([True]), "abc", b"abc", [[1, 2], [3, 4]], 5,
], ids=repr)
def test_tokens_outside_int32_ids_raise_never_wrap(tokens):
    with pytest.raises((ValueError, TypeError)):
        KEYER.keys(tokens)


def test_extreme_tokens_key_the_same_whatever_their_container():
    tokens = [INT32_MAX, 0, INT32_MAX, 1] * (PAGE // 2)
    expected = KEYER.keys(tokens)
    assert len(expected) == 2
    for same in (tuple(tokens), np.array(tokens, dtype=np.int32), np.array(tokens, dtype=np.int64),
                 np.array(tokens, dtype=np.uint32), torch.tensor(tokens, dtype=torch.int64)):
        assert KEYER.keys(same) == expected
    # One less in an extreme token changes the key (no two ids collapse onto one when packed).
    assert KEYER.keys([INT32_MAX - 1, *tokens[1:]])[0] != expected[0]


def common_pages(a: np.ndarray, b: np.ndarray) -> int:
    """Brute force: whole pages of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return (int(differ[0]) if differ.size else n) // PAGE


class RadixOracle:
    """A tree and what a brute-force model says it must answer. Every page key seen is remembered
    with the tokens it was made from, so two different prefixes with one key would be caught."""

    def __init__(self) -> None:
        self.tree = RadixTree()
        self.inserted: list[np.ndarray] = []
        self.seen: list[np.ndarray] = []
        self.key_at: dict[bytes, tuple[int, int]] = {}  # page key -> (index in `seen`, pages of prefix)
        self.value_of: dict[bytes, int] = {}  # the value the first insert gave each page
        self.next_value = 0

    def keys(self, tokens: list[int]) -> list[bytes]:
        keys = KEYER.keys(tokens)
        arr = np.asarray(tokens, dtype=np.int64)
        assert len(keys) == len(arr) // PAGE
        here = len(self.seen)
        self.seen.append(arr)
        shared: dict[int, int] = {}
        for i, key in enumerate(keys):
            j, pages = self.key_at.setdefault(key, (here, i + 1))
            assert pages == i + 1, "one page key names prefixes of two lengths"
            if j != here:
                if j not in shared:
                    shared[j] = common_pages(arr, self.seen[j])
                assert shared[j] >= pages, "two different token prefixes share a page key"
        return keys

    def insert(self, tokens: list[int]) -> None:
        keys = self.keys(tokens)
        arr = np.asarray(tokens, dtype=np.int64)
        values = np.arange(self.next_value, self.next_value + len(keys))
        self.next_value += len(keys)
        result = self.tree.insert(keys, values)
        assert result.num_existing == max((common_pages(arr, s) for s in self.inserted), default=0)
        for key, value in zip(keys, values.tolist(), strict=True):
            self.value_of.setdefault(key, value)
        self.inserted.append(arr)
        self.tree.check_integrity()

    def check_match(self, tokens: list[int]) -> None:
        keys = self.keys(tokens)
        arr = np.asarray(tokens, dtype=np.int64)
        result = self.tree.match_prefix(keys)
        expected = max((common_pages(arr, s) for s in self.inserted), default=0)
        assert result.num_pages == expected, f"matched {result.num_pages} pages, brute force says {expected}"
        assert result.values.tolist() == [self.value_of[k] for k in keys[:expected]]
        self.tree.check_integrity()


extreme_tokens = st.one_of(st.integers(0, 2), st.sampled_from([0, 1, INT32_MAX, INT32_MAX - 1, 2**31 // 2]),
                           st.integers(0, INT32_MAX))
token_lists = st.lists(extreme_tokens, max_size=6 * PAGE + 5)  # lengths of any alignment, empty included


@st.composite
def related(draw: st.DrawFn, seqs: list[list[int]]) -> list[int]:
    """A sequence that shares a prefix of any length with one already drawn, then differs."""
    if not seqs or draw(st.booleans()):
        return draw(token_lists)
    base = draw(st.sampled_from(seqs))
    keep = draw(st.integers(0, len(base)))
    return base[:keep] + draw(token_lists)


@settings(max_examples=examples(125))
@given(data=st.data())
def test_radix_matches_equal_brute_force_on_adversarial_tokens(data):
    oracle = RadixOracle()
    drawn: list[list[int]] = []
    for _ in range(data.draw(st.integers(1, 8))):
        tokens = data.draw(related(drawn))
        drawn.append(tokens)
        if data.draw(st.booleans()):
            oracle.insert(tokens)
        else:
            oracle.check_match(tokens)
    for tokens in drawn:
        oracle.check_match(tokens)
        oracle.check_match(tokens[:len(tokens) // 2] + [INT32_MAX] * PAGE)


@pytest.mark.parametrize("fill", [0, 7, INT32_MAX])
def test_long_sequences_of_one_token(fill):
    """100k equal tokens: every page holds the same tokens, yet every key differs (the chain)."""
    tokens = [fill] * 100_000 + [fill] * 5  # not page-aligned: the tail gets no key
    oracle = RadixOracle()
    oracle.insert(tokens)
    keys = KEYER.keys(tokens)
    assert len(keys) == 100_000 // PAGE and len(set(keys)) == len(keys)
    oracle.check_match(tokens)
    other = 1 if fill != 1 else 2
    for at in (0, 1, PAGE - 1, PAGE, 12_345, 99_999, 100_003):
        oracle.check_match(tokens[:at] + [other] + tokens[at + 1:])  # one token changed: a split there
    oracle.check_match(tokens[:50_000])
    assert oracle.tree.num_nodes >= 3


def test_empty_and_sub_page_sequences_match_nothing():
    oracle = RadixOracle()
    for tokens in ([], [1], list(range(PAGE - 1))):
        assert KEYER.keys(tokens) == []
        oracle.insert(tokens)
        oracle.check_match(tokens)
    assert oracle.tree.num_nodes == 0 and oracle.tree.size_info() == (0, 0)
    result = oracle.tree.match_prefix([])
    assert result.num_pages == 0 and result.values.size == 0
