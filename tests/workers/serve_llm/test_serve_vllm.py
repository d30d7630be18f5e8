"""`cluster start --engine vllm` for real: a Ray Serve LLM application of 2 vLLM replicas (vLLM's
CPU build, SmolLM2) with our connector over a store shard, our request router and our front end,
on a local Ray cluster. A repeat goes to the replica that holds it; while that replica is busy,
a prompt whose prefix only the store holds goes to the idle one, which loads it from the store;
answers equal a from-scratch computation (a cache salt of its own); the router follows the
shard's own events under the connector's keys; no token, no answer; a replica killed under a
request or mid-way through a stream, the answers still whole; a dead shard means recompute, with
the same answers.

Engines start for minutes: `make test-serve` runs this module (in `.venv-vllm`, which has vLLM
and Ray Serve), CI runs it after `make test`; the tests share one application, in order."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray.serve.llm")  # needs pyarrow: the vLLM venv has it, .venv does not

import ray

from tiered_cache.integrations.document import document
from tiered_cache.workers import cluster
from tiered_cache.workers.config import ClusterConfig

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(900)]
NAMESPACE = "test-serve-vllm"
TOKEN = "serve-test-token"
SHARD_TOKEN = "serve-shard-token"
PORT = 18247


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    ray.init(num_cpus=8, namespace=NAMESPACE, include_dashboard=False, logging_level="WARNING",
             log_to_driver=False)
    config = ClusterConfig.from_dict({
        "namespace": NAMESPACE, "shards": 1, "engine": "vllm", "kv_events": "tcp://127.0.0.1:0",
        "shard": {"disk_path": None, "ram_capacity": "256MiB", "host": "127.0.0.1", "token": SHARD_TOKEN},
        "vllm": {"replicas": 2, "host_capacity": "64MiB", "max_model_len": 2048}})
    try:
        infos = cluster.start(config)
        shards = [i["address"] for i in infos if i["kind"] == "shard"]
        url = cluster.serve_vllm(config, shards, "127.0.0.1", PORT, TOKEN)
        # Until Serve has polled both replicas' routing stats (their event endpoints), the router
        # routes without events (a fallback, counted): warm up until it follows both, and the shard.
        deadline = time.monotonic() + 120
        ask(url, "Say hello.", max_tokens=1, salt="warm-up")  # Serve makes the router on the first request
        while (len(router(url)["replicas"]) < 2 or "shard-0" not in router(url)["sources"]) \
                and time.monotonic() < deadline:
            time.sleep(1.0)
            ask(url, "Say hello.", max_tokens=1, salt="warm-up")
        yield {"url": url, "config": config, "fallbacks": router(url)["fallbacks"]}
    finally:
        cluster.stop(NAMESPACE)
        ray.shutdown()


def post(url: str, path: str, body: dict, token: str | None = TOKEN, timeout_s: float = 300) -> tuple[int, dict]:
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def ask(url: str, prompt: str, max_tokens: int = 10, salt: str | None = None) -> dict:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt  # another namespace for vLLM's prefix cache and our connector: recomputed
    status, answer = post(url, "/completions", body)
    assert status == 200, answer
    return answer


def cached(answer: dict) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def front_end(url: str) -> dict:
    """The front end's own figures: its routers' and the requests it sent again."""
    request = urllib.request.Request(url.removesuffix("/v1") + "/tiered-cache/router",
                                     headers={"authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def router(url: str) -> dict:
    routers = front_end(url)["routers"]
    assert len(routers) == 1  # one ingress replica, one router in it
    return routers[0]


def routed_to(url: str, before: dict) -> str:
    """The replica the router sent the one request since `before` (its stats then) to."""
    after = router(url)["routed"]
    moved = [r for r, n in after.items() if n != before.get(r, 0)]
    assert len(moved) == 1, (before, after)
    return moved[0]


def question(q: str, start: int = 0) -> str:
    return f"{document()[start:start + 2000]}\n\nQuestion: {q}\nAnswer in one sentence."


def test_each_engine_timed_a_prefill_at_start_outside_our_tiers_and_the_router_learned_it(app):
    """Before the first request each replica's engine prefilled a probe of random tokens, timed
    (the router's first routes are priced by it, not by a guess): the router took one sample per
    replica, and the probes' blocks (32 each) were neither looked up in our tiers nor saved to
    the store (the fixture's warm-up prompts are shorter than a block)."""
    deadline = time.monotonic() + 30  # Serve polls each replica's routing stats every 2 s
    while router(app["url"])["estimate"]["prefill_probes"] < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    stats = router(app["url"])
    assert stats["estimate"]["prefill_probes"] == 2 and stats["estimate"]["prefill_s_per_token"] > 0
    connectors = cluster.stats()["vllm"]["routers"][0]["connectors"]
    assert len(connectors) == 2
    assert sum(c.get("lookups", 0) + c.get("blocks_saved", 0) for c in connectors.values()) == 0
    assert stats["sources"]["shard-0"]["pages"] == 0


def test_no_token_no_answer_and_no_bind_beyond_loopback_without_one(app):
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2}
    for token in (None, "wrong"):
        status, answer = post(app["url"], "/completions", body, token=token)
        assert status == 401 and "bearer token" in answer["error"]["message"]
    status, answer = post(app["url"], "/completions", {"model": "smollm2", "prompt": "Hello", "max_tokens": -3})
    assert status == 400 and "max_tokens" in json.dumps(answer)  # vLLM's validation, one message
    for raw, why in ((b'{"model": "smollm2", "prompt": ', "not JSON"), (b"[1, 2]", "a JSON list")):
        request = urllib.request.Request(app["url"] + "/completions", raw, {"authorization": f"Bearer {TOKEN}"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 400 and why in json.loads(refused.value.read())["error"]["message"]
    # A JSON body sent as a form (curl -d without a content type) is still read as JSON.
    plain = urllib.request.Request(app["url"] + "/chat/completions", json.dumps(
        {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi!"}]}).encode(),
        {"authorization": f"Bearer {TOKEN}", "content-type": "application/x-www-form-urlencoded"})
    with urllib.request.urlopen(plain, timeout=300) as answered:
        assert answered.status == 200 and json.loads(answered.read())["choices"][0]["message"]["content"]
    with pytest.raises(ValueError, match="beyond loopback"):
        cluster.serve_vllm(app["config"], [], "0.0.0.0", PORT, None)


def test_a_repeat_goes_to_its_holder_and_a_busy_holder_s_prefix_is_loaded_by_the_idle_replica(app):
    url = app["url"]
    first_q = question("In what year was the lighthouse's lamp first lit?")
    before = router(url)["routed"]
    first = ask(url, first_q)
    holder = routed_to(url, before)
    time.sleep(1.0)  # the engine's events for it reach the router
    before = router(url)["routed"]
    repeat = ask(url, first_q)
    assert routed_to(url, before) == holder and cached(repeat) >= 256  # its own prefix cache
    route = repeat["tiered_cache"]  # the answer says where it went and why
    assert route["replica"] == holder and route["reason"] == "events" and route["expected_cached_tokens"] >= 256
    assert route["expected_from"]["device"] >= 256  # which tier: the holder's own device
    assert repeat["choices"][0]["text"] == first["choices"][0]["text"]

    # The holder busy with a long answer: the next prompt on the same document goes to the idle
    # replica, which has never seen it, and loads the document's blocks from the store.
    busy = threading.Thread(target=ask, args=(url, question("Tell the whole story.", 6000), 200))
    busy.start()
    deadline = time.monotonic() + 60
    while router(url)["in_flight"].get(holder, 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    before = router(url)["routed"]
    second_q = question("In what year was the light automated?")
    second = ask(url, second_q)
    other = routed_to(url, before)
    busy.join(timeout=300)
    assert other != holder and second["tiered_cache"]["replica"] == other
    # What the router expected there it knew from the shard's events (it follows a shard: the store
    # is what shards tell), under the connector's keys.
    assert second["tiered_cache"]["expected_cached_tokens"] >= 256
    assert second["tiered_cache"]["expected_from"]["store"] >= 256  # which tier: the store, not its device
    # Why not the holder: the answer shows what the router believed there (its device held the
    # document, with the long prefill ahead of it) beside what it chose.
    passed_over = second["tiered_cache"]["others"][holder]
    assert passed_over["expected_from"]["device"] >= 256 and passed_over["expected_wait_ms"] > 0
    assert passed_over["score_ms"] >= second["tiered_cache"]["score_ms"]
    streamed = urllib.request.Request(url + "/completions", json.dumps(
        {"model": "smollm2", "prompt": second_q, "max_tokens": 2, "stream": True}).encode(),
        {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"})
    with urllib.request.urlopen(streamed, timeout=300) as answer:
        route = json.loads(answer.headers["x-tiered-cache-route"])  # a stream says its route in a header
        assert route["reason"] == "events" and route["replica"] in (holder, other) and answer.read()
    assert cached(second) >= 256  # from the store: this replica never computed the document
    reference = ask(url, second_q, salt=f"reference-{uuid.uuid4()}")
    assert cached(reference) == 0 and second["choices"][0]["text"] == reference["choices"][0]["text"]
    stats = router(url)
    assert stats["fallbacks"] == app["fallbacks"] and all(s["fresh"] for s in stats["sources"].values())


def test_stats_show_the_router_and_each_replica_s_connector_figures(app):
    from tiered_cache.cli.cluster_table import render_cluster

    deadline = time.monotonic() + 30  # Serve polls each replica's routing stats every 2 s

    def connectors() -> dict:
        return cluster.stats()["vllm"]["routers"][0]["connectors"]

    while sum(c.get("lookups", 0) for c in connectors().values()) < 4 and time.monotonic() < deadline:
        time.sleep(0.5)
    figures = cluster.stats()
    router_figures = figures["vllm"]["routers"][0]
    assert sum(router_figures["routed"].values()) >= 5 and router_figures["fallbacks"] == app["fallbacks"]
    replicas = router_figures["connectors"]
    assert len(replicas) == 2 and sum(c.get("lookups", 0) for c in replicas.values()) >= 4
    assert sum(c.get("blocks_hit", 0) for c in replicas.values()) > 0  # the idle replica's load
    # The replicas' engines timed their loads, and the router prices the store by that time.
    assert sum(c.get("blocks_loaded", 0) for c in replicas.values()) > 0
    assert sum(c.get("load_seconds", 0) for c in replicas.values()) > 0
    assert router_figures["estimate"]["store_timed"]
    assert sum(c.get("blocks_saved", 0) for c in replicas.values()) > 0
    # The idle replica was told to start loading the document before its engine scheduled it.
    assert sum(c.get("hinted_blocks", 0) for c in replicas.values()) > 0
    assert sum(c.get("hints_failed", 0) for c in replicas.values()) == 0
    # The router keys prompts by the connector's chain (its replicas said it) and follows the shard's
    # own events: the pages the replicas saved are there, under the keys the connector gave them.
    assert router_figures["keying"]["page_size"] > 0 and router_figures["keying"]["groups"] >= 1
    assert router_figures["sources"]["shard-0"]["pages"] > 0
    text = render_cluster(figures)
    assert "vLLM application" in text and all(f"replica {r}" in text for r in replicas)


def test_cluster_generate_answers_through_the_front_end_with_its_token(app):
    q = question("Who kept the lighthouse?", 3000)
    status, direct = post(app["url"], "/chat/completions", {"model": "smollm2", "max_tokens": 8, "temperature": 0,
                                                           "messages": [{"role": "user", "content": q}]})
    assert status == 200, direct
    got = cluster.generate(q, 8, token=TOKEN)  # `tiered-cache cluster generate`: one user turn, as HF workers
    assert got["text"] == direct["choices"][0]["message"]["content"]
    assert got["prompt_tokens"] == direct["usage"]["prompt_tokens"] > ask(app["url"], q, 1)["usage"]["prompt_tokens"]
    assert got["route"]["reason"] == "events" and got["reused_tokens"] >= 256 and got["ttft_s"] > 0
    reference = cluster.generate(q, 8, use_cache=False, token=TOKEN)
    assert reference["reused_tokens"] == 0 and reference["text"] == got["text"]
    with pytest.raises(RuntimeError, match="wants its token"):
        cluster.generate(q, 8)


def test_a_replica_killed_mid_request_every_request_is_still_answered(app):
    """The replica answering a long request dies: the front end sends it again to a live replica
    (Serve drops the dead one and starts another), and the requests after it are answered too."""
    url = app["url"]
    prompt = question("Tell the whole story again.", 5000)
    reference = ask(url, prompt, max_tokens=64, salt=f"reference-{uuid.uuid4()}")
    answers: list[dict] = []
    long_request = threading.Thread(target=lambda: answers.append(ask(url, prompt, max_tokens=64)))
    long_request.start()
    deadline = time.monotonic() + 60
    busy: list[str] = []
    while not busy and time.monotonic() < deadline:
        busy = [r for r, n in router(url)["in_flight"].items() if n > 0]
        time.sleep(0.05)
    assert busy, "the long request never showed in flight"
    [victim] = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == "serve" and busy[0] in a["name"] and "LLMServer" in a["name"]]
    ray.kill(ray.get_actor(victim["name"], namespace="serve"), no_restart=True)
    long_request.join(timeout=300)
    assert answers and answers[0]["choices"][0]["text"] == reference["choices"][0]["text"]
    after = ask(url, question("In what year was the lighthouse's lamp first lit?"))
    assert after["choices"][0]["text"] and after["tiered_cache"]["replica"] != busy[0]


def test_a_stream_whose_replica_dies_mid_way_is_finished_by_a_live_one(app):
    """The replica streaming a chat answer dies after its first tokens: the front end asks a live
    replica for the rest (the prompt and the answer so far as token ids) and the client reads one
    stream: the greedy text of an uninterrupted answer, one id, usage over the whole answer."""
    url = app["url"]
    deadline = time.monotonic() + 300
    while len(router(url)["replicas"]) < 2 and time.monotonic() < deadline:  # the last test's victim replaced
        time.sleep(1.0)
        ask(url, "Say hello.", max_tokens=1, salt="warm-up")  # the router meets a new replica when it routes
    assert len(router(url)["replicas"]) == 2
    prompt = question("Tell the story of the keepers, one by one.", 8000)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": 160,
            "temperature": 0, "ignore_eos": True}
    status, reference = post(url, "/chat/completions", {**body, "cache_salt": f"reference-{uuid.uuid4()}"})
    assert status == 200, reference
    resumed_before = front_end(url)["retried"]["streams_resumed"]
    request = urllib.request.Request(url + "/chat/completions", json.dumps(
        {**body, "stream": True, "stream_options": {"include_usage": True}}).encode(),
        {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"})
    chunks: list[dict] = []
    killed_at = done = 0
    with urllib.request.urlopen(request, timeout=300) as answer:
        replica = json.loads(answer.headers["x-tiered-cache-route"])["replica"]
        for raw in answer:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = len(chunks)
            elif line.startswith("data:"):
                chunks.append(json.loads(line[5:]))
                said = chunks[-1]["choices"] and chunks[-1]["choices"][0]["delta"].get("content")
                if said and not killed_at:
                    [victim] = [a for a in ray.util.list_named_actors(all_namespaces=True)
                                if a["namespace"] == "serve" and replica in a["name"] and "LLMServer" in a["name"]]
                    ray.kill(ray.get_actor(victim["name"], namespace="serve"), no_restart=True)
                    killed_at = len(chunks)
    assert killed_at and done == len(chunks)
    assert front_end(url)["retried"]["streams_resumed"] == resumed_before + 1
    from tiered_cache.cli.cluster_table import render_vllm

    figures = cluster.stats()["vllm"]  # what `stats --ray` shows: the request above, this stream
    assert figures["retried"]["requests_sent_again"] >= 1 and figures["retried"]["streams_resumed"] >= 1
    assert "streams finished on another replica" in "\n".join(render_vllm(figures))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == reference["choices"][0]["message"]["content"]
    assert {(c["id"], c["object"]) for c in chunks} == {(chunks[0]["id"], "chat.completion.chunk")}
    assert not any("token_ids" in c or "token_ids" in ch for c in chunks for ch in c["choices"])  # not asked
    usage = chunks[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == \
        (reference["usage"]["prompt_tokens"], reference["usage"]["completion_tokens"])


def test_a_dead_shard_means_recompute_with_the_same_answers(app):
    url = app["url"]
    shard = ray.get_actor("shard-0")
    ray.kill(shard, no_restart=True)
    prompt = question("Who was the first keeper of the light?", 3000)  # a document slice nobody computed
    answer = ask(url, prompt)
    reference = ask(url, prompt, salt=f"reference-{uuid.uuid4()}")
    assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached(reference) == 0


def test_a_shard_back_on_another_port_is_followed_without_a_redeploy(app):
    """The dead shard starts again while another process holds its old port: it serves on a free
    one, the replicas keep the directory's list in their node's file, and their connectors save to
    and load from the shard at its new address."""
    from tiered_cache.cache.address_file import read_addresses
    from tiered_cache.client.store_client import StoreClient
    from tiered_cache.workers.serve_llm.shard_list import shard_list_path

    url, listed = app["url"], shard_list_path(NAMESPACE)
    [old] = read_addresses(listed)
    host, port = old.rsplit(":", 1)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind((host, int(port)))
        squatter.listen()
        moved = ray.get(cluster.start_shard("shard-0", app["config"]).ping.remote(), timeout=120)
    assert moved != old
    deadline = time.monotonic() + 60
    while read_addresses(listed) != [moved] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert read_addresses(listed) == [moved]
    time.sleep(2.0)  # the engines look at the file every second
    prompt = question("What did the keeper write in the log?", 9000)  # a slice nobody computed
    first = ask(url, prompt)
    store = StoreClient(moved, token=SHARD_TOKEN)
    deadline = time.monotonic() + 30  # saved in the background
    while store.stats().tiers[0].pages == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert store.stats().tiers[0].pages > 0  # saved at the new address
    again = ask(url, prompt, max_tokens=10)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_the_router_marks_a_request_to_load_ahead_only_where_the_device_lacks_the_prefix():
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from tiered_cache.workers.routing.policy import Decision
    from tiered_cache.workers.serve_llm.request_router import _say_load_ahead, load_ahead

    class Pending:
        def __init__(self, body):
            self.args = [body]

    body = CompletionRequest(model="smollm2", prompt="hi", kv_transfer_params={"theirs": 1})
    _say_load_ahead(Pending(body), Decision("a", "events", 0, expected=(128, 0, 384)))  # the store holds more
    assert load_ahead(body) and body.kv_transfer_params["theirs"] == 1
    _say_load_ahead(Pending(body), Decision("b", "events", 0, expected=(384, 0, 384)))  # asked again: a holder
    assert not load_ahead(body) and body.kv_transfer_params == {"theirs": 1}
    plain = CompletionRequest(model="smollm2", prompt="hi")
    _say_load_ahead(Pending(plain), Decision("a", "balance", 0))
    assert not load_ahead(plain) and plain.kv_transfer_params is None


def test_the_connector_tells_a_salted_chain_s_salt_and_the_router_keys_its_blocks_under_it():
    """A salted request's blocks, as the connector hands them to vLLM's publisher, carry the salt
    on the chain's first block (as vLLM's own do): the router's index keys them in the salt's
    namespace, where the connector keeps their pages, and nowhere else."""
    from types import SimpleNamespace

    import msgpack
    import msgspec
    from vllm.v1.core.kv_cache_utils import BlockHash

    from tiered_cache.events.schema import MEDIUM_CPU
    from tiered_cache.index.keys import chain_keys, root_key
    from tiered_cache.integrations.vllm.block_events import BlockEvents
    from tiered_cache.workers.routing.token_chain import TokenChainIndex

    fingerprint, block, tokens = "cd" * 32, 4, list(range(500, 512))
    request = SimpleNamespace(block_hashes=[BlockHash(bytes([i]) * 32) for i in range(3)], all_token_ids=tokens,
                              cache_salt="tenant-x", lora_request=None)
    told = BlockEvents(list)
    told.saved(request, 0, [b"k0", b"k1"], block)
    told.saved(request, 2, [b"k2"], block)
    events = [msgpack.unpackb(msgspec.msgpack.encode(e), raw=False) for e in told.take()]
    index = TokenChainIndex(root_key("", fingerprint), salted=lambda salt: root_key(salt, fingerprint))
    index.apply(events)
    assert index.leading(chain_keys(tokens, block, root_key("tenant-x", fingerprint)), (MEDIUM_CPU,)) == 3
    assert index.leading(chain_keys(tokens, block, root_key("", fingerprint)), (MEDIUM_CPU,)) == 0
