"""The README's local walk, command for command, against the session's 3-node Ray cluster:
`cluster start` (two workers holding a GPU each, and the HTTP front end), `cluster status`,
`cluster generate` (twice: the repeat reuses the prefix), the OpenAI-compatible endpoints,
`stats --ray` (totals are the sums of the rows), `cluster stop` (nothing left behind).

The commands run through `tiered-cache`'s own entry point in this process (conftest
`run_cli_here`), one Ray connection for the whole walk: each in a fresh interpreter spent ~3 s
importing and joining Ray, a dozen times over."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli_here as run_cli

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow
NAMESPACE = "walk"


def test_the_cluster_commands_start_use_report_and_stop(ray_cluster, tmp_path):
    where = ["--address", ray_cluster.address, "--namespace", NAMESPACE]
    ray.shutdown()  # the commands join the cluster themselves, in the walk's namespace
    try:
        _walk(ray_cluster, where, tmp_path)
    finally:
        ray.shutdown()


def _walk(ray_cluster, where: list[str], tmp_path) -> None:
    # Two workers holding one GPU each (the session's nodes 1 and 2 advertise one; the work runs on
    # the CPU, as `--device cpu` asks), two shards one per node.
    port = free_port()
    started = run_cli("cluster", "start", *where, "--shards", "2", "--workers", "2", "--gpus", "1", "--device", "cpu",
                      "--disk", str(tmp_path), "--serve", "--http-port", str(port))
    assert started.stdout.count("cpu (GPU 0)") == 2 and f"HTTP: http://127.0.0.1:{port}/v1" in started.stdout
    assert "2 store shard(s): one per node" in started.stderr
    try:
        status = json.loads(run_cli("cluster", "status", *where, "--json").stdout)
        shards = [a for a in status["actors"] if a["kind"] == "shard"]
        assert len(shards) == 2 and len({s["node_id"] for s in shards}) == 2  # one per node
        workers = [a for a in status["actors"] if a["kind"] == "worker"]
        assert len(workers) == 2 and len({w["node_id"] for w in workers}) == 2  # a GPU node each
        assert all(w["gpu_ids"] == ["0"] and w["device"] == "cpu" for w in workers)
        assert all(w["weights_dtype"] == "float32" and w["kv_dtype"] == "float16" for w in workers)  # CPU defaults
        table = run_cli("cluster", "status", *where).stdout
        assert "shard-0" in table and "shard-1" in table and "worker-1" in table
        assert table.count("cpu (GPU 0)") == 2

        prompt = "Tiered KV caches keep hot pages on the GPU and cold ones below. " * 12 + "Summarise."
        first = json.loads(run_cli("cluster", "generate", *where, prompt, "--max-new-tokens", "6", "--json").stdout)
        again = json.loads(run_cli("cluster", "generate", *where, prompt, "--max-new-tokens", "6", "--json").stdout)
        assert first["reused_tokens"] == 0 and again["reused_tokens"] > 0 and again["tokens"] == first["tokens"]
        served = first["worker"]
        assert again["route"] == {"worker": served, "reason": "prefix", "matched_chars": len(prompt)}
        text = run_cli("cluster", "generate", *where, prompt, "--max-new-tokens", "6").stdout
        assert served in text and "reused" in text
        for bad_prompt, reason in (("", "non-empty prompt"), ("word " * 9000, "past the model's context")):
            refused = run_cli("cluster", "generate", *where, bad_prompt, check=False)
            last = refused.stderr.strip().splitlines()[-1]
            assert refused.returncode == 2 and last.startswith("tiered-cache cluster: error: ") and reason in last
            assert "Traceback" not in refused.stderr and "\x1b[" not in refused.stderr  # no remote traceback
        trees = json.loads(run_cli("tree", "--ray", ray_cluster.address, "--namespace", NAMESPACE, "--json").stdout)
        assert [t["worker"] for t in trees] == ["worker-0", "worker-1"]
        (tree,) = [t for t in trees if t["worker"] == served]
        (branch,) = tree["namespaces"][0]["children"]  # one prompt, asked three times: one node
        assert branch["hits"] >= 2 and "Tiered KV caches keep hot pages" in branch["head_text"] + branch["tail_text"]

        _http(f"http://127.0.0.1:{port}/v1")
        _rerun(where, tmp_path, port)

        figures = json.loads(run_cli("stats", "--ray", ray_cluster.address, "--namespace", NAMESPACE,
                                     "--json").stdout)
        for name, total in figures["totals"].items():
            rows = [t for a in figures["actors"] for t in (a["tiers"] if a["kind"] == "shard"
                                                            else a["cache"]["tiers"]) if t["name"] == name]
            for key in ("pages", "used_bytes", "hits", "misses", "bytes_in"):
                assert total[key] == sum(int(r[key]) for r in rows), (name, key)
        assert figures["totals"]["ram"]["pages"] > 0  # the worker wrote its pages through to the shards
        table = run_cli("stats", "--ray", ray_cluster.address, "--namespace", NAMESPACE).stdout
        assert "cluster total" in table and f"router (prefix): routed {served} " in table
    finally:
        stopped = run_cli("cluster", "stop", *where, "--json")
    with pytest.raises(OSError):  # the front end went with the cluster
        post(f"http://127.0.0.1:{port}/v1", "/completions", {"prompt": "x"})
    assert sorted(json.loads(stopped.stdout)["stopped"]) == ["directory", "router", "shard-0", "shard-1", "worker-0",
                                                             "worker-1"]
    assert ray.get_runtime_context().namespace == NAMESPACE  # the connection the commands made
    assert ray.util.list_named_actors() == []
    from ray.util.placement_group import get_placement_group

    with pytest.raises(ValueError):
        get_placement_group(f"{NAMESPACE}-shards")
    empty = run_cli("cluster", "status", *where, "--json", check=False)
    assert empty.returncode == 1 and json.loads(empty.stdout)["actors"] == []
    assert f"no tiered-cache actors in Ray namespace '{NAMESPACE}'" in empty.stderr
    none = run_cli("stats", "--ray", where[1], "--namespace", NAMESPACE, check=False)
    assert none.returncode == 1 and "start them with `tiered-cache cluster start`" in none.stderr


def _rerun(where: list[str], tmp_path, port: int) -> None:
    """`cluster start` again on a serving cluster never changes what is served silently: another
    port or host is refused in one line naming the running bind (which keeps answering), a token
    given now is applied for real, and the printed URL is the one that answers."""
    base = f"http://127.0.0.1:{port}/v1"
    start = ("cluster", "start", *where, "--shards", "2", "--workers", "2", "--gpus", "1", "--device", "cpu",
             "--disk", str(tmp_path), "--serve")
    for moved in (("--http-port", str(port + 1)), ("--http-host", "0.0.0.0", "--http-port", str(port),
                                                   "--http-token", "T0ken-0123456789")):
        refused = run_cli(*start, *moved, check=False)
        last = refused.stderr.strip().splitlines()[-1]
        assert refused.returncode == 2 and f"already listens on 127.0.0.1:{port}" in last, refused.stderr
        assert post(base, "/models", b"")[0] in (200, 405)  # still served where it was
    token = "re-run-token-0123456789"
    again = run_cli(*start, "--http-port", str(port), "--http-token", token)
    assert f"HTTP: {base}" in again.stdout
    # Nothing loads on a re-run: the running workers are kept, and it says so.
    assert "loading" not in again.stderr and "2 cache worker(s) running already" in again.stderr
    import urllib.request

    def models(authorization: str | None) -> int:
        request = urllib.request.Request(base + "/models", headers={"Authorization": authorization} if authorization
                                         else {})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert models(None) == 401 and models(f"Bearer {token}") == 200  # the token is in force


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(base: str, path: str, body: dict | bytes) -> tuple[int, bytes]:
    """(status, body) of a POST, as any HTTP client sends it."""
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def answer(base: str, path: str, body: dict) -> dict:
    status, raw = post(base, path, body)
    assert status == 200, raw
    return json.loads(raw)


def _http(base: str) -> None:
    """The OpenAI-compatible front end: two completions sharing a long prefix (the second reuses
    it, with the answer a no-cache request gives), a chat streamed as server-sent events equal to
    the same chat answered whole, and bad requests refused with a 400 and their reason."""
    doc = "The lighthouse at Corran Bay was built of granite and first lit in the winter storms. " * 8
    first = answer(base, "/completions", {"prompt": doc + "It was first lit in", "max_tokens": 5})
    assert first["object"] == "text_completion" and first["usage"]["completion_tokens"] == 5
    second = answer(base, "/completions", {"prompt": doc + "It was built of", "max_tokens": 5})
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 64 and sum(second["tiered_cache"]["sources"].values()) == cached
    assert second["tiered_cache"]["route"]["reason"] == "prefix"  # to the worker that holds the prefix
    reference = answer(base, "/completions", {"prompt": doc + "It was built of", "max_tokens": 5, "cache": False})
    assert reference["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["choices"][0]["text"] == reference["choices"][0]["text"]

    chat = {"messages": [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": doc + "What was it built of?"}], "max_tokens": 6}
    whole = answer(base, "/chat/completions", chat)
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["role"] == "assistant"
    status, raw = post(base, "/chat/completions", {**chat, "stream": True})
    events = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    assert status == 200 and events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert len(chunks) >= 6 and streamed == whole["choices"][0]["message"]["content"]  # as generated, unstripped
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # asked again: its prefix is held

    for body, reason in ((b"{not json", "not JSON"), ({"prompt": ""}, "prompt must be a non-empty string"),
                         ({"prompt": "word " * 9000, "max_tokens": 4}, "past the model's context"),
                         ({"prompt": "x", "temperature": 0.7}, "temperature must be 0"),
                         ({"prompt": "x", "max_tokens": -1}, "max_tokens must be a positive integer")):
        status, raw = post(base, "/completions", body)
        assert status == 400 and reason in json.loads(raw)["error"]["message"], raw
    status, raw = post(base, "/chat/completions", {"messages": [{"role": "user"}], "stream": True})
    assert status == 400 and "messages[0]" in json.loads(raw)["error"]["message"]


def test_a_bad_cluster_config_is_refused_before_connecting(tmp_path):
    bad = tmp_path / "cluster.yaml"
    bad.write_text("shards: 2\nworker:\n  modle: smollm2\n")
    result = run_cli("cluster", "start", "--address", "127.0.0.1:1", "--config", str(bad), check=False)
    assert result.returncode == 2 and "worker.modle" in result.stderr


def test_the_vllm_engine_from_a_python_without_vllm_is_one_line_naming_the_venv_that_has_it():
    """vLLM and Ray Serve live in `.venv-vllm`: `cluster start --engine vllm` and `bench serve`'s
    vLLM ways from the main venv stop before connecting or starting anything, in one line."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this Python has vLLM")
    for command in (["cluster", "start", "--engine", "vllm", "--address", "127.0.0.1:1"],
                    ["bench", "serve", "--ways", "bd"]):
        result = run_cli(*command, check=False)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert "vllm not installed in this Python" in lines[0] and ".venv-vllm/bin/tiered-cache" in lines[0]


def test_a_ray_address_nobody_answers_on_fails_in_seconds_with_one_line():
    ray.shutdown()  # not joined to any cluster: the commands must reach the address themselves
    closed = free_port()  # bound and released: nothing listens there now
    for command in (["cluster", "status", "--address", f"127.0.0.1:{closed}"],
                    ["stats", "--ray", f"127.0.0.1:{closed}"]):
        result = run_cli(*command, check=False)
        assert result.returncode == 2, result.stderr
        assert f"no Ray cluster at 127.0.0.1:{closed}" in result.stderr and "Traceback" not in result.stderr
        assert not ray.is_initialized()
    malformed = run_cli("cluster", "status", "--address", "localhost", check=False)
    assert malformed.returncode == 2 and "expected HOST:PORT" in malformed.stderr


def test_a_start_that_fails_says_why_in_one_line_and_leaves_nothing_behind(ray_cluster, tmp_path):
    ray.shutdown()
    try:
        failed = run_cli("cluster", "start", "--address", ray_cluster.address, "--namespace", "bad-model",
                         "--shards", "0", "--workers", "1", "--model", str(tmp_path / "no-such-model"), check=False)
        assert failed.returncode == 2, failed.stderr
        last = failed.stderr.strip().splitlines()[-1]
        assert last.startswith("tiered-cache cluster: error: worker-0 failed to start") and "no-such-model" in last
        assert "Traceback" not in failed.stderr
        assert "stopped what this start had started: directory" in failed.stderr, failed.stderr  # worker-0 died
        assert ray.util.list_named_actors() == []  # in the namespace the command joined
    finally:
        ray.shutdown()
