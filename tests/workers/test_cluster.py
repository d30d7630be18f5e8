"""The Ray cluster on a real 3-node local cluster (conftest `ray_cluster`): workers on two nodes
share a document's prefix through a store shard on a third, the router sends a repeat where the
prefix lives, a killed shard turns its keys into misses while the survivor keeps serving, and
`stats --ray` adds up what each actor reports."""

from __future__ import annotations

import socket
import time

import pytest

ray = pytest.importorskip("ray")

from tiered_cache.integrations.document import document  # noqa: E402
from tiered_cache.workers import cluster  # noqa: E402
from tiered_cache.workers.config import ClusterConfig, RouterSettings, ShardSettings, WorkerSettings  # noqa: E402

pytestmark = pytest.mark.slow
NAMESPACE = "test-cluster"
MAX_NEW = 12
TOKEN = "cluster-test-token"  # the shards require it; the workers send it


def question(q: str, doc: str | None = None) -> str:
    return f"{doc or document()[:2400]}\n\nQuestion: {q}\nAnswer in one sentence."


@pytest.fixture(scope="module")
def actors(ray_cluster, tmp_path_factory):
    """Directory on the head, shard-0 on node0, worker-0 on node1, worker-1 on node2, and the router."""
    ray.init(address=ray_cluster.address, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
    # KV events on and the event router: every test below, the chaos ones too, runs the event path.
    config = ClusterConfig(namespace=NAMESPACE, watch_interval_s=0.5, kv_events="tcp://127.0.0.1:0",
                           router=RouterSettings(policy="events"),
                           shard=ShardSettings(disk_path=str(tmp_path_factory.mktemp("shards")), token=TOKEN,
                                               ram_capacity="256MiB", host="127.0.0.1", num_cpus=0.5),
                           worker=WorkerSettings(max_new_tokens=MAX_NEW, num_cpus=1))
    cluster.start_directory(config)
    shard = cluster.start_shard("shard-0", config, resources={"node0": 1})
    ray.get(shard.ping.remote())
    a = cluster.start_worker("worker-0", config, resources={"node1": 1})
    b = cluster.start_worker("worker-1", config, resources={"node2": 1})
    ray.get([a.ping.remote(), b.ping.remote()], timeout=300)
    yield {"config": config, "a": a, "b": b, "shard": shard}
    cluster.stop(NAMESPACE)
    ray.shutdown()


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def serving(address: str) -> bool:
    import grpc

    from tiered_cache.client.store_client import StoreClient

    try:
        with StoreClient(address, TOKEN, timeout_s=1.0) as client:
            client.stats()
    except grpc.RpcError:
        return False
    return True


def test_a_prefix_computed_on_one_node_is_reused_on_another(actors):
    a, b = actors["a"], actors["b"]
    first = ray.get(a.generate.remote(question("In what year was the lighthouse's lamp first lit?")))
    assert first["reused_tokens"] == 0 and first["stored_tokens"] > 0
    assert ray.get(a.flush.remote())  # the write-through to the shard is done
    prompt = question("In what year was the light automated?")
    reused = ray.get(b.generate.remote(prompt))
    reference = ray.get(b.generate.remote(prompt, use_cache=False))
    nodes = {ray.get(x.info.remote())["node_id"] for x in (a, b, actors["shard"])}
    assert len(nodes) == 3  # worker A, worker B and the shard each on their own node
    assert reused["reused_tokens"] >= first["prompt_tokens"] // 2  # the document, not just a page
    assert reused["sources"].get("remote", 0) == reused["reused_tokens"]  # all from the shard
    assert reused["tokens"] == reference["tokens"] and reused["text"] == reference["text"]
    assert reference["reused_tokens"] == 0
    import grpc

    from tiered_cache.client.store_client import StoreClient

    address = ray.get(actors["shard"].ping.remote())
    with pytest.raises(grpc.RpcError) as refused, StoreClient(address) as stranger:
        stranger.lookup([b"k" * 32])  # without the token: refused, while the workers got in
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_router_sends_a_repeat_to_the_worker_that_holds_it(actors):
    router = cluster.start_router(actors["config"])
    # Worker A answered this prompt before the router existed: the router learns it from A's KV
    # events (their replay), and the device pages there beat B's copy in the store.
    repeat = ray.get(router.generate.remote(question("In what year was the lighthouse's lamp first lit?")))
    assert repeat["route"]["worker"] == repeat["worker"] == "worker-0" and repeat["route"]["reason"] == "events"
    assert repeat["sources"].get("device", 0) == repeat["reused_tokens"] > repeat["prompt_tokens"] - 16
    prompt = question("Who built the lighthouse?")
    first = ray.get(router.generate.remote(prompt))
    assert ray.get(ray.get_actor(first["worker"]).flush.remote())
    again = ray.get(router.generate.remote(prompt))
    assert again["route"]["worker"] == first["route"]["worker"] == first["worker"]
    # The cached tokens it expected: every full page of the prompt, on that worker's device.
    route = again["route"]
    assert route["reason"] == "events" and route["matched_tokens"] == again["prompt_tokens"] // 16 * 16
    assert again["sources"].get("device", 0) == again["reused_tokens"] > 0  # served from that worker's own pool
    assert again["tokens"] == first["tokens"]
    other = ray.get(router.generate.remote(question("What is this about?", "A short note. " * 40)))
    assert other["route"]["reason"] == "events" and other["tokens"]
    stats = ray.get(router.stats.remote())
    assert sum(stats["routed"].values()) == 4 and stats["failures"] == 0
    events = stats["events"]
    assert events["estimate"]["samples"] == 4  # it learned from every answer
    assert {"worker-0", "worker-1", "shard-0"} <= set(events["sources"])
    assert all(s["pages"] > 0 and s["batches"] > 0 for s in events["sources"].values())


def test_a_killed_shard_gives_misses_then_the_ring_heals_from_the_workers_pages(actors):
    a, b, config = actors["a"], actors["b"], actors["config"]
    extra = cluster.start_shard("shard-1", config, resources={"node1": 1})
    ray.get(extra.ping.remote())
    wait_for(lambda: all(len(ray.get(w.info.remote())["shards"]) == 2 for w in (a, b)), what="rings of 2 shards")
    prompt = question("How tall is the tower?", document()[2400:4800])
    ray.get(a.generate.remote(prompt))  # A computes it; B never asks for it until the end
    assert ray.get(a.flush.remote())
    pages = ray.get(b.where.remote(prompt))
    assert all(p["held"] for p in pages), pages  # including pages A held from before shard-1 joined
    assert len({p["shard"] for p in pages}) == 2  # spread over both shards
    by_address = {ray.get(x.ping.remote()): x for x in (extra, actors["shard"])}
    survivor_address = pages[1]["shard"]
    victim = next(x for address, x in by_address.items() if address != survivor_address)
    reference = ray.get(b.generate.remote(prompt, use_cache=False))
    ray.kill(victim, no_restart=True)
    # ray.kill does not wait: the actor and its server go away shortly after.
    victim_address = next(address for address in by_address if address != survivor_address)
    wait_for(lambda: not serving(victim_address), what="the killed shard's port to close")
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(victim.ping.remote(), timeout=30)
    # Whether or not the directory has noticed yet, asking is no error and the dead shard holds nothing.
    during = ray.get(b.where.remote(prompt), timeout=60)
    assert all(p["shard"] == survivor_address for p in during if p["held"])
    assert any(p["held"] for p in during)  # the survivor's pages are still there
    # Once it has, the ring is the survivor alone: A still holds the whole prompt in host RAM and
    # puts the dead shard's share to its new owner, so B finds every page again.
    for worker in (a, b):
        wait_for(lambda w=worker: ray.get(w.info.remote())["shards"] == [survivor_address], what="ring update")
    assert ray.get(a.flush.remote())
    after = ray.get(b.where.remote(prompt))
    assert all(p["shard"] == survivor_address and p["held"] for p in after), after
    late = ray.get(b.generate.remote(prompt), timeout=60)
    assert late["tokens"] == reference["tokens"]
    page_size = config.worker.page_size
    assert late["reused_tokens"] == min(len(pages) * page_size, late["prompt_tokens"] - 1)
    # Page 0 is the chat template's header, in B's own pool if it answered anything before; the
    # rest came from the surviving shard.
    assert sum(late["sources"].values()) == late["reused_tokens"]
    assert late["sources"]["remote"] >= late["reused_tokens"] - page_size


def test_stats_rollup_equals_the_sum_of_the_actors_own_figures(actors):
    figures = cluster.stats()
    kinds = sorted(a["kind"] for a in figures["actors"] if "error" not in a)
    assert kinds.count("worker") == 2 and kinds.count("shard") >= 1
    own = [ray.get(ray.get_actor(a["name"]).stats.remote()) for a in figures["actors"] if "error" not in a]
    expected: dict[str, dict[str, int]] = {}
    for actor in own:
        for tier in cluster.tiers_of(actor):
            row = expected.setdefault(tier["name"], {"pages": 0, "hits": 0, "misses": 0, "used_bytes": 0})
            for key in row:
                row[key] += int(tier[key])
    assert set(figures["totals"]) == set(expected) >= {"device", "host", "remote", "ram"}
    for name, row in expected.items():
        for key, value in row.items():
            assert figures["totals"][name][key] == value, (name, key)
    assert figures["totals"]["remote"]["hits"] > 0  # workers did load from the shards
    # The router's own figures beside them: what it routed where and why, the event policy's fallbacks.
    (router,) = [c["figures"] for c in figures["control"] if c["kind"] == "router"]
    own_router = ray.get(ray.get_actor("router").stats.remote())
    assert router["routed"] == own_router["routed"] and sum(router["routed"].values()) > 0
    assert router["policy"] == "events" and router["events"]["fallbacks"] == own_router["events"]["fallbacks"]
    from tiered_cache.cli.cluster_cmd import render_status
    from tiered_cache.cli.cluster_table import render_cluster

    for text in (render_status(figures), render_cluster(figures)):
        assert "router (events): routed worker-" in text and "event fallbacks" in text
    # Where each shard publishes its KV events, in `cluster status` and in what `cluster start` prints.
    from tiered_cache.cli.cluster_cmd import render_actors

    shard = next(a for a in figures["actors"] if a["kind"] == "shard" and "error" not in a)
    endpoint = shard["events"]["endpoint"]
    assert endpoint.startswith("tcp://127.0.0.1:") and endpoint in render_status(figures)
    assert endpoint in render_actors([ray.get(ray.get_actor(shard["name"]).info.remote())])


def test_each_worker_draws_its_prefix_tree_with_text(actors):
    from tiered_cache.report.tree import render_tree

    view = ray.get(ray.get_actor("worker-0").tree.remote(50))
    assert view["worker"] == "worker-0" and view["namespaces"]
    stack = [n for ns in view["namespaces"] for n in ns["children"]]
    texts = []
    while stack:
        node = stack.pop()
        texts.append(node.get("head_text") or "")
        stack.extend(node["children"])
    assert any(t.startswith("<|im_start|>") for t in texts)  # every prompt starts with the chat template
    drawn = render_tree(view, "worker-0:")
    assert drawn.startswith("worker-0:\nnamespace (default)") and "└── " in drawn


@pytest.mark.long  # a benchmark run, not the cache's correctness: make test-long
def test_store_traffic_through_the_router_answers_as_recompute_does_and_leaves_the_cluster_running(actors, tmp_path):
    from tiered_cache.bench.store_traffic.through_ray import RayTrafficSettings, bench_store_traffic_ray
    from tiered_cache.bench.store_traffic.workload import Workload

    cluster.start_router(actors["config"])  # the cluster this bench must leave running, router included
    png = tmp_path / "ray-store-traffic.png"
    # Long enough for each client's later turns, which share its first turn's prefix, on a busy machine too.
    settings = RayTrafficSettings(Workload(prompts=3, histories=2, max_turns=4, seed=11), clients=2, duration_s=8,
                                  namespace=NAMESPACE, max_new_tokens=2, verify=2, png=str(png))
    result = bench_store_traffic_ray(settings)
    for phase in (result.recompute, result.cache):
        assert phase.requests > 0 and phase.errors == {} and phase.clients == 2
        assert 0 < phase.p50_ms <= phase.p99_ms <= phase.p999_ms and phase.ttft_p50_ms > 0
        assert sum(phase.routes.values()) == phase.requests and set(phase.routes) <= {"worker-0", "worker-1"}
    assert result.recompute.reused_tokens == 0 and result.cache.reused_tokens > 0  # prefixes were shared
    assert result.answers.recomputed > 0 and result.answers.answers_compared > 0 and result.answers.wrong == 0
    assert (result.workers, result.shards) == (2, 1) and result.tiers["ram"]["pages"] > 0
    sampled = {m.name for m in result.memory}  # one host: every actor sampled
    assert sampled >= {"worker-0", "worker-1"} and any(n.startswith("shard-") for n in sampled)
    assert all(b > 0 for m in result.memory for _, b in m.samples)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"router", "worker-0", "worker-1"} <= set(cluster.actor_names())  # a running cluster is left running


def test_workers_and_shards_export_the_cache_metrics_through_ray(actors):
    """Ray's own Prometheus export (each node's metrics agent) carries the same families as
    `/metrics`, prefixed `ray_`, tagged with the actor: what the Grafana dashboard reads."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    ports = [(n["NodeManagerAddress"], n["MetricsExportPort"]) for n in ray.nodes() if n["Alive"]]
    wanted = {("worker-0", "device"), ("worker-1", "device")}  # a counter appears once it has grown
    found: dict[tuple[str, str, str], float] = {}
    deadline = time.monotonic() + 60  # actors publish every 5 s, Ray's agents export every few seconds
    while time.monotonic() < deadline:
        found.clear()
        for host, port in ports:
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
                text = response.read().decode()
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name.startswith("ray_tiered_cache_") and "actor" in s.labels:
                        found[(s.name, s.labels["actor"], s.labels.get("tier", ""))] = s.value
        have = {(a, t) for (name, a, t) in found if name == "ray_tiered_cache_tier_hits_total"}
        if wanted <= have and any(k[0] == "ray_tiered_cache_tier_get_seconds_count" for k in found):
            break
        time.sleep(2)
    assert wanted <= have, sorted(found)[:20]
    assert found[("ray_tiered_cache_tier_hits_total", "worker-0", "device")] > 0
    assert any(n == "ray_tiered_cache_tier_capacity_bytes" and a.startswith("shard-") and t == "ram"
               for n, a, t in found)
    assert any(n == "ray_tiered_cache_tier_get_seconds_count" and t == "remote" for n, _, t in found)
    assert any(n == "ray_tiered_cache_server_requests_total" for n, _, _ in found)


@pytest.mark.long  # a restart drill past the suite's time budget: make test-long (CI runs it)
def test_a_restarted_directory_finds_the_running_actors_again(actors):
    a, b = actors["a"], actors["b"]
    router = cluster.start_router(actors["config"])
    routed = question("Who lit the lamp?", "A note about the harbour wall and its repairs. " * 40)
    assert cluster.generate(routed)["tokens"]  # the router has met the workers
    before = {w: ray.get(w.info.remote()) for w in (a, b)}
    misses = ray.get(router.stats.remote())["directory_misses"]
    ray.kill(ray.get_actor("directory"), no_restart=True)  # gone for good: no restart
    wait_for(lambda: "directory" not in ray.util.list_named_actors(), what="the directory to go")
    # Meanwhile the router routes to the workers it knows, and the workers keep their ring.
    time.sleep(1.1)  # past the router's refresh window: it looks for the directory again
    assert cluster.generate(routed)["tokens"]
    assert ray.get(router.stats.remote())["directory_misses"] > misses
    prompt = question("Is the light still working?")
    assert ray.get(a.generate.remote(prompt), timeout=120)["tokens"]
    assert ray.get(a.flush.remote())
    assert ray.get(b.generate.remote(prompt), timeout=120)["sources"].get("remote", 0) > 0  # through the shard
    cluster.start_directory(actors["config"])
    running = {n for n in ray.util.list_named_actors() if n.startswith(("shard-", "worker-"))}
    assert {"worker-0", "worker-1"} < running  # and the shard(s) that earlier tests left alive

    def members() -> set[str]:
        return {m["name"] for m in ray.get(ray.get_actor("directory").snapshot.remote())["members"]}

    wait_for(lambda: members() == running, timeout_s=30, what="the new directory to find every running actor")
    # The new directory's version once it found them all (it counts up as each one joins).
    version = ray.get(ray.get_actor("directory").snapshot.remote())["version"]
    assert version > max(before[w]["ring_version"] for w in (a, b))
    shards = sorted(ray.get(ray.get_actor(n).ping.remote()) for n in running if n.startswith("shard-"))
    for worker in (a, b):  # they follow the new directory and never lost a shard
        info = wait_for(lambda w=worker: (i := ray.get(w.info.remote()))["ring_version"] >= version and i,
                        timeout_s=30, what="a worker to follow the new directory")
        assert info["shards"] == shards


# --- chaos (last in the module: the second test may kill a worker the others use) -----------------
SHARD_NODES = {"shard-0": {"node0": 1}, "shard-1": {"node1": 1}}


def _alive(name: str) -> bool:
    try:
        ray.get(ray.get_actor(name).ping.remote(), timeout=30)
    except (ValueError, ray.exceptions.RayError):
        return False
    return True


@pytest.mark.long  # a restart drill past the suite's time budget: make test-long (CI runs it)
def test_chaos_a_killed_shard_restarted_rejoins_the_ring_and_serves_again(actors):
    a, b, config = actors["a"], actors["b"], actors["config"]
    prompt = question("What colour is the lighthouse?", document()[4800:7200])
    reference = ray.get(b.generate.remote(prompt, use_cache=False))
    for name, resources in SHARD_NODES.items():  # both up (the kill test above left one dead)
        ray.get(cluster.start_shard(name, config, resources=resources).ping.remote(), timeout=120)
    wait_for(lambda: all(len(ray.get(w.info.remote())["shards"]) == 2 for w in (a, b)), what="rings of 2 shards")
    ray.get(a.generate.remote(prompt))
    assert ray.get(a.flush.remote())
    victim_name = "shard-1"
    victim_address = ray.get(ray.get_actor(victim_name).ping.remote())
    assert any(p["shard"] == victim_address for p in ray.get(b.where.remote(prompt)))
    ray.kill(ray.get_actor(victim_name), no_restart=True)
    wait_for(lambda: not serving(victim_address), what="the killed shard's port to close")
    for worker in (a, b):
        wait_for(lambda w=worker: len(ray.get(w.info.remote())["shards"]) == 1, what="ring without the victim")
    # Restarted under the same name, on its node, over its disk folder: the ring takes it back.
    restarted = cluster.start_shard(victim_name, config, resources=SHARD_NODES[victim_name])
    address = ray.get(restarted.ping.remote(), timeout=120)
    assert address == victim_address  # its port again: a fixed list of shards (vLLM's connector) stays true
    for worker in (a, b):
        wait_for(lambda w=worker: address in ray.get(w.info.remote())["shards"], what="ring with the restarted shard")
    assert ray.get(a.flush.remote())
    pages = wait_for(lambda: (lambda p: p if all(x["held"] for x in p) else None)(ray.get(b.where.remote(prompt))),
                     what="every page held again")
    assert any(p["shard"] == address for p in pages)  # the restarted shard owns and holds its share
    late = ray.get(b.generate.remote(prompt), timeout=120)
    assert late["tokens"] == reference["tokens"] and late["sources"].get("remote", 0) > 0

    # Restarted while another process holds its old port: it serves on a free one, and the ring follows.
    ray.kill(ray.get_actor(victim_name), no_restart=True)
    wait_for(lambda: not serving(address), what="the killed shard's port to close")
    host, port = address.rsplit(":", 1)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind((host, int(port)))
        squatter.listen()
        moved = ray.get(cluster.start_shard(victim_name, config, resources=SHARD_NODES[victim_name]).ping.remote(),
                        timeout=120)
    assert moved != address
    for worker in (a, b):
        wait_for(lambda w=worker: moved in ray.get(w.info.remote())["shards"], what="ring with the moved shard")


def test_chaos_a_worker_killed_mid_request_the_router_answers_from_another(actors):
    config = actors["config"]
    router = cluster.start_router(config)
    extra = cluster.start_worker("worker-2", config, resources={"node0": 1})
    ray.get(extra.ping.remote(), timeout=300)
    wait_for(lambda: "worker-2" in ray.get(router.stats.remote())["workers"], what="the router to see worker-2")
    stats = ray.get(router.stats.remote())
    before, idle = stats["failures"], stats["in_flight"]  # a test before may still have a request in flight
    prompt = question("Describe the keeper's day.", "An unrelated text about gardens. " * 60)
    pending = router.generate.remote(prompt, 48)
    busy = wait_for(lambda: [w for w, n in ray.get(router.stats.remote())["in_flight"].items() if n > idle.get(w, 0)],
                    timeout_s=60, what="the request to reach a worker")
    victim = busy[0]
    ray.kill(ray.get_actor(victim), no_restart=True)  # mid-request: it is generating
    answer = ray.get(pending, timeout=300)  # an answer, never a hang
    assert answer["worker"] != victim and answer["route"]["worker"] != victim
    assert len(answer["tokens"]) > 0
    stats = ray.get(router.stats.remote())
    assert stats["failures"] == before + 1 and victim not in stats["workers"]


@pytest.mark.long  # a soak over the single-kill tests above, past the suite's time budget: make test-long
def test_chaos_each_actor_kind_killed_twice_is_restarted_in_place_and_every_request_is_answered(actors):
    """Ray restarts a crashed directory, router, shard or worker in place (`max_restarts`): the
    same name and handles, state recovered from the cluster: all four kinds killed at once, twice
    (each alone is covered by the tests above: a directory gone, a shard killed, a worker killed
    mid-request). Every request through the router, during the restarts and after them, gets the
    no-cache answer; a call in flight on the router when it dies runs again on the restarted
    router. `cluster status` counts the restarts."""
    config = actors["config"]
    router = cluster.start_router(config)
    prompt = question("Who keeps the lighthouse now?")
    # The router routes by where pages are: the worker the test before killed may be any of them.
    workers = [w for w in ("worker-0", "worker-1", "worker-2") if _alive(w)]
    reference = ray.get(ray.get_actor(workers[-1]).generate.remote(prompt, use_cache=False), timeout=120)["tokens"]

    def ask() -> None:
        assert cluster.generate(prompt, timeout_s=300)["tokens"] == reference

    ask()
    kinds = ("directory", "router", "shard-0", workers[0])
    base = {name: cluster.restarts(name) for name in kinds}
    for kill in (1, 2):  # all four at once, twice, a request in flight on the router each time
        in_flight = router.generate.remote(prompt)
        for name in kinds:
            ray.kill(ray.get_actor(name), no_restart=False)  # a crash: Ray restarts it
        # The restarted router runs the call again, waiting (bounded) for the restarted directory
        # to tell it the workers; worker-1 answers while worker-0 reloads its model.
        assert ray.get(in_flight, timeout=300)["tokens"] == reference
        ask()  # during the restarts
        for name in kinds:
            wait_for(lambda n=name, k=kill: cluster.restarts(n) == base[n] + k and _alive(n), timeout_s=180,
                     what=f"{name} restarted after kill {kill}")
        ask()
    figures = cluster.stats()
    counted = {a["name"]: a["restarts"] for a in figures["actors"] + figures["control"]}
    assert {name: counted[name] - base[name] for name in kinds} == dict.fromkeys(kinds, 2)
    from tiered_cache.cli.cluster_cmd import render_status

    row = next(line for line in render_status(figures).splitlines() if " shard-0 " in f" {line} ")
    assert f" {counted['shard-0']} " in row  # the restarts column
