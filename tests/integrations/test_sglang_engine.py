"""tiered-cache under real SGLang servers (CPU engine, SmolLM2-135M) sharing one real store server:
a second instance reads the first one's prefix from storage with the same greedy answer, through
the zero-copy v1 calls and the generic ones; an instance reads its own prefix back after
`/flush_cache`; a dead store means recompute and reuse comes back with it; a corrupt page is never
served; another model reads nothing. Run by `make test-sglang` (in .venv-sglang)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from tiered_cache.bench.redis_process import free_port
from tiered_cache.bench.sglang_server import OUR_BACKEND, SGLangServer, model_folder
from tiered_cache.client.store_client import StoreClient
from tiered_cache.server.process import StoreProcess

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
PAGE = 16
DOC = (Path(__file__).resolve().parents[2] / "tiered_cache" / "data" / "document.txt").read_text()


def prompt(i: int) -> str:
    """A prompt of about 290 tokens of its own: the i-th 1,200 characters of the document."""
    return DOC[i * 1200:(i + 1) * 1200] + "\nQuestion: what is this passage about?\nAnswer: It is about"


class Store:
    """One store server (disk written through, so a restart keeps its pages) on a fixed port."""

    def __init__(self, folder: Path) -> None:
        self.port, self.folder = free_port(), folder
        self.process: StoreProcess | None = None
        self.start()

    def start(self) -> None:
        self.process = StoreProcess(["--port", str(self.port), "--disk", str(self.folder), "--write-through",
                                     "--ram", "256MiB"])
        self.process.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def tiers(self) -> dict:
        return {t.name: t for t in StoreClient(self.address).stats().tiers}

    def wait_for_pages(self, pages: int, timeout_s: float = 60.0) -> None:
        """SGLang backs pages up to storage after the request: wait until the store holds them."""
        deadline = time.monotonic() + timeout_s
        while self.tiers()["ram"].pages < pages:
            assert time.monotonic() < deadline, f"the store holds {self.tiers()['ram'].pages} pages, expected {pages}"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def model() -> str:
    return model_folder()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[Store]:
    store = Store(tmp_path_factory.mktemp("store"))
    yield store
    store.process.stop()


def config(store: Store, v1: bool = True, **extra) -> dict:
    # SGLang's prefetch deadline (1 s by default) would make a reuse depend on how busy the machine
    # is; these tests ask what is read, so they give it time (SGLang takes the key, not us).
    return {**OUR_BACKEND, "remote_addresses": store.address, "remote_timeout_s": 2.0, "prefetch_timeout_base": 60,
            **({"interface_v1": 1} if v1 else {}), **extra}


@pytest.fixture(scope="module")
def first(model, store, tmp_path_factory) -> Iterator[SGLangServer]:
    with SGLangServer(model, tmp_path_factory.mktemp("a") / "sglang.log", extra=config(store)) as server:
        yield server


@pytest.fixture(scope="module")
def second(model, store, tmp_path_factory) -> Iterator[SGLangServer]:
    with SGLangServer(model, tmp_path_factory.mktemp("b") / "sglang.log", extra=config(store)) as server:
        yield server


@pytest.fixture(scope="module")
def references(first, store) -> dict[int, dict]:
    """The first instance's answers with every cache empty: what any reuse must reproduce."""
    out = {}
    for i in (0, 1):
        out[i] = first.generate(prompt(i))
        assert out[i]["cached"] == 0
    store.wait_for_pages(2 * (out[0]["prompt"] // PAGE) - 2)
    return out


def full_pages(reply: dict) -> int:
    """Tokens of the prompt's full pages short of the last token (SGLang computes at least one)."""
    return (reply["prompt"] - 1) // PAGE * PAGE


def test_a_second_instance_reads_the_first_ones_prefix_from_storage(first, second, references, store):
    hits_before = store.tiers()["ram"].hits
    got = second.generate(prompt(0))
    assert got["storage"] == full_pages(references[0]) and got["text"] == references[0]["text"]
    assert store.tiers()["ram"].hits > hits_before
    first.flush()  # its device and host caches: its own prefix now comes back from storage
    again = first.generate(prompt(0))
    assert again["storage"] == full_pages(references[0]) and again["text"] == references[0]["text"]


def test_the_generic_interface_shares_pages_with_the_v1_one(model, second, references, store, tmp_path):
    with SGLangServer(model, tmp_path / "sglang.log", extra=config(store, v1=False)) as generic:
        got = generic.generate(prompt(1))  # pages the first instance wrote through v1
        assert got["storage"] == full_pages(references[1]) and got["text"] == references[1]["text"]
        held = store.tiers()["ram"].pages
        own = generic.generate(prompt(2))  # its own, written through the generic calls
        store.wait_for_pages(held + own["prompt"] // PAGE - 1)
    read = second.generate(prompt(2))
    assert read["storage"] == full_pages(own) and read["text"] == own["text"]


def test_a_dead_store_means_recompute_and_reuse_comes_back_with_it(first, second, references, store):
    store.process.kill()
    start = time.monotonic()
    alone = second.generate(prompt(3))  # nothing stored can be read: computed, answered
    assert alone["storage"] == 0 and alone["text"]
    first.flush()
    recomputed = first.generate(prompt(0))
    assert recomputed["storage"] == 0 and recomputed["text"] == references[0]["text"]
    assert time.monotonic() - start < 120
    store.start()  # the same port and disk: the pages written through are there again
    deadline = time.monotonic() + 60
    while True:
        first.flush()
        back = first.generate(prompt(1))
        if back["storage"] or time.monotonic() > deadline:
            break
        time.sleep(2)  # the backend's breaker tries the server again after its cool-down
    assert back["storage"] == full_pages(references[1]) and back["text"] == references[1]["text"]


def test_a_corrupt_page_in_the_store_is_recomputed_and_counted(first, second, store):
    # A prompt of its own, its pages in the store before they are spoiled: a backup an earlier test
    # left pending (the store was down) cannot put good pages back under the ones read here.
    held = store.tiers()["ram"].pages
    reference = first.generate(prompt(4))
    assert reference["cached"] == 0
    store.wait_for_pages(held + reference["prompt"] // PAGE - 1)
    first.flush()
    assert first.generate(prompt(4))["storage"] == full_pages(reference)  # read back while intact
    store.process.stop()
    pages = [p for p in store.folder.rglob("*") if p.is_file() and len(p.name) == 64]
    assert pages
    for path in pages:  # every page file: whichever the reader asks first is bad
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    store.start()
    # Read by the instance that made no call while the store was down (the first one may have,
    # and its breaker would skip the store; its recompute would then write good pages back).
    got = second.generate(prompt(4))
    assert got["storage"] == 0 and got["text"] == reference["text"]  # never a spoiled page
    assert sum(t.corrupt for t in store.tiers().values()) >= 1


def test_another_model_reads_nothing_of_the_first_ones(model, references, store, tmp_path):
    extra = config(store, model_id="another-model")
    with SGLangServer(model, tmp_path / "sglang.log", extra=extra) as other:
        got = other.generate(prompt(1))
    assert got["storage"] == 0 and got["cached"] == 0 and got["text"] == references[1]["text"]
