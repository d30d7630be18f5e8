"""KV events on a real ZMQ socket pair: numbered batches, replay for a subscriber that starts late,
a full queue that drops and counts, loopback unless allowed, and vLLM's own event classes and
decoder (in .venv-vllm) reading our batches unchanged."""

from __future__ import annotations

import time

import pytest

zmq = pytest.importorskip("zmq")

from vllm_events import vllm_batches  # noqa: E402

from tiered_cache.events.endpoints import check_endpoint  # noqa: E402
from tiered_cache.events.publisher import END_OF_REPLAY, EventPublisher  # noqa: E402
from tiered_cache.events.schema import (  # noqa: E402
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    all_blocks_cleared,
    block_removed,
    block_stored,
    decode_batch,
)

BATCHES = [
    [block_stored([b"\x01" * 32, b"\x02" * 32], None, list(range(32)), 16, MEDIUM_GPU)],
    [block_stored([b"\x03" * 32], b"\x02" * 32, list(range(32, 48)), 16, MEDIUM_STORAGE, locality="REMOTE"),
     block_removed([b"\x01" * 32], MEDIUM_GPU)],
    [block_stored([7, 8], 6, list(range(32)), 16, MEDIUM_CPU), all_blocks_cleared()],
]


def replay(endpoint: str, first: int) -> list[tuple[int, bytes]]:
    """What a late subscriber gets back from the replay endpoint, from batch `first` on."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", first.to_bytes(8, "big")))
        got = []
        while True:
            _, _, number, payload = sock.recv_multipart()
            if number == END_OF_REPLAY:
                return got
            got.append((int.from_bytes(number, "big"), payload))
    finally:
        sock.close()


def published(publisher: EventPublisher, count: int) -> None:
    deadline = time.monotonic() + 10
    while publisher.published < count:
        assert time.monotonic() < deadline, f"{publisher.published} of {count} batches published"
        time.sleep(0.01)


def test_batches_are_numbered_replayed_and_sent_live():
    publisher = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv")
    try:
        for batch in BATCHES:
            assert publisher.publish(batch)
        published(publisher, 3)
        kept = replay(publisher.replay_endpoint, 0)
        first = publisher.first_seq  # the wall clock's microseconds at start: past an earlier publisher's
        assert first > 1_700_000_000 * 10**6 and [n for n, _ in kept] == [first, first + 1, first + 2]
        assert [decode_batch(p)[1] for _, p in kept] == BATCHES
        assert [n for n, _ in replay(publisher.replay_endpoint, first + 2)] == [first + 2]
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVTIMEO, 200)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(publisher.endpoint)
        deadline, live = time.monotonic() + 10, None
        while live is None and time.monotonic() < deadline:  # a SUB joins a moment after connecting
            publisher.publish(BATCHES[0])
            try:
                live = sub.recv_multipart()
            except zmq.Again:
                continue
        sub.close()
        assert live is not None and live[0] == b"kv" and int.from_bytes(live[1], "big") >= first + 3
        assert decode_batch(live[2])[1] == BATCHES[0]
    finally:
        publisher.close()


def test_a_full_queue_drops_and_counts_instead_of_blocking():
    publisher = EventPublisher("tcp://127.0.0.1:0", max_queue=1)
    try:
        accepted = sum(publisher.publish(BATCHES[1]) for _ in range(2_000))
    finally:
        publisher.close()
    assert publisher.dropped > 0 and accepted + publisher.dropped == 2_000
    assert publisher.published == accepted


def test_endpoints_are_loopback_unless_allowed():
    with pytest.raises(ValueError, match="listens beyond loopback"):
        check_endpoint("tcp://0.0.0.0:5557")
    assert check_endpoint("tcp://0.0.0.0:5557", beyond_loopback=True) == "tcp://0.0.0.0:5557"
    assert check_endpoint("tcp://localhost:5557") == "tcp://127.0.0.1:5557"
    for bad in ("127.0.0.1:5557", "tcp://127.0.0.1", "tcp://127.0.0.1:99999", "ipc:///tmp/x"):
        with pytest.raises(ValueError, match=r"tcp://HOST:PORT|port 0-65535"):
            check_endpoint(bad)


@pytest.mark.long  # a vLLM process (make test-long); test_store_events.py runs vLLM's decoder in make test
def test_vllm_s_own_decoder_reads_our_batches_unchanged():
    publisher = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    try:
        for batch in BATCHES:
            publisher.publish(batch)
        published(publisher, 3)
        decoded = vllm_batches(publisher.replay_endpoint)
    finally:
        publisher.close()
    assert [[kind for kind, _ in batch] for batch in decoded] == [[e["type"] for e in b] for b in BATCHES]
    stored = decoded[1][0][1]
    assert stored["medium"] == MEDIUM_STORAGE and stored["locality"] == "REMOTE" and stored["block_size"] == 16
    assert stored["token_ids"] == list(range(32, 48)) and decoded[2][0][1]["block_hashes"] == [7, 8]
    assert decoded[1][1][1]["medium"] == MEDIUM_GPU


def test_a_quiet_publisher_with_a_heartbeat_sends_empty_batches_and_one_without_sends_none():
    beating = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", heartbeat_s=0.05)
    quiet = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    try:
        beating.publish(BATCHES[0])
        published(beating, 4)
        # Numbered like any batch, but not kept: the replay holds only what changed.
        kept = replay(beating.replay_endpoint, 0)
        assert [decode_batch(p)[1] for _, p in kept] == [BATCHES[0]]
        assert kept[0][0] < beating.first_seq + beating.published
        assert quiet.published == 0
    finally:
        beating.close()
        quiet.close()
