"""The background queues behind write-behind: bounded, never blocking the caller, and (for the
lower-tier writer) at a lower CPU priority than the request threads."""

import os
import sys
import threading

import pytest

from tiered_cache.cache.background import BACKGROUND_NICE, BackgroundQueue


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_a_full_queue_drops_and_counts_and_never_blocks_the_caller():
    started, gate, ran = threading.Event(), threading.Event(), []
    q = BackgroundQueue("test", capacity=2)
    assert q.submit(lambda: (started.set(), gate.wait(10)))
    assert started.wait(10)  # running: the queue behind it fills
    accepted = [q.submit(ran.append, i) for i in range(5)]
    assert accepted.count(True) == 2 and accepted.count(False) == 3
    gate.set()
    assert q.flush(10)
    figures = q.stats()
    assert (figures.submitted, figures.done, figures.dropped, figures.failed) == (3, 3, 3, 0)
    assert ran == [i for i, ok in enumerate(accepted) if ok]
    q.close()


def test_a_failing_job_is_counted_and_the_thread_keeps_serving():
    q = BackgroundQueue("test", capacity=4)
    ran = []
    q.submit(lambda: 1 / 0)
    q.submit(ran.append, "after")
    assert q.flush(10) and ran == ["after"] and q.stats().failed == 1
    q.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are a Linux feature")
def test_a_niced_queue_runs_below_the_caller_and_leaves_the_caller_alone():
    before = _own_nice()
    seen = []
    niced, plain = BackgroundQueue("niced", 2, nice=BACKGROUND_NICE), BackgroundQueue("plain", 2)
    niced.submit(lambda: seen.append(("niced", _own_nice())))
    plain.submit(lambda: seen.append(("plain", _own_nice())))
    assert niced.flush(10) and plain.flush(10)
    assert dict(seen) == {"niced": min(19, before + BACKGROUND_NICE), "plain": before}
    assert _own_nice() == before  # only the queue's own thread changed
    niced.close()
    plain.close()
