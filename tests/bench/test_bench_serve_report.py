"""`bench serve`'s report from outcomes (no engines: the outcomes are built here): the summary's
quantiles and cache share, answers compared by key, and the per-request dump lined up by arrival."""

from tiered_cache.bench.serve.client import Outcome
from tiered_cache.bench.serve.report import outcomes, summary
from tiered_cache.bench.serve.runner import WayRun
from tiered_cache.bench.serve.workload import ServeWorkload


def _run(way: str, keys: list[str], ttft: dict[str, float], text: dict[str, str]) -> WayRun:
    return WayRun(way, [Outcome(k, ttft_s=ttft[k], latency_s=ttft[k] + 1, text=text.get(k, "same"), prompt_tokens=100,
                                cached_tokens=50 if ttft[k] < 1 else 0, output_tokens=16) for k in keys], wall_s=10.0)


def test_outcomes_line_up_by_arrival_and_the_summary_compares_answers_by_key():
    requests = ServeWorkload(2, 2, 300, 1, 2, 1.0, 5).requests()
    keys = [r.key for r in requests]
    late_first = list(reversed(keys))  # a way's outcomes come back in any order
    ttft = {k: 0.1 * (i + 1) if i % 2 else 2.0 + i for i, k in enumerate(keys)}
    first = _run("b", keys, ttft, {})
    other = _run("d", late_first, ttft, {keys[0]: "different"})

    dumped = outcomes([first, other], requests)
    assert list(dumped) == ["b", "d"]
    for rows in dumped.values():
        assert [r["key"] for r in rows] == keys  # arrival order, whatever order they came back in
        assert [r["arrival_s"] for r in rows] == [r.arrival_s for r in requests]
        assert [r["ttft_s"] for r in rows] == [ttft[k] for k in keys]

    row = summary(other, first)
    assert row["answers_compared"] == len(keys) and row["answers_equal"] == len(keys) - 1
    assert row["cached_share"] == sum(50 for k in keys if ttft[k] < 1) / (100 * len(keys))


def test_a_streamed_answer_is_read_with_its_route_and_a_bad_route_header_is_none():
    """`send` against a real HTTP server streaming an answer as an OpenAI front end does: its
    text, TTFT, usage and our router's route header; a header that is not a JSON object reads as
    no route, and the answer still counts."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tiered_cache.bench.serve.client import send
    from tiered_cache.workers.names import ROUTE_HEADER

    routes = iter(['{"replica":"r1","reason":"events","expected_from":{"store":96}}', "not json"])

    class Answer(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header(ROUTE_HEADER, next(routes))
            self.end_headers()
            for chunk in ({"choices": [{"delta": {"content": "Hello"}}]},
                          {"choices": [{"delta": {"content": " there"}}]},
                          {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 2,
                                                    "prompt_tokens_details": {"cached_tokens": 32}}}):
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        routed = send(url, None, "doc0-q0", {"messages": []})
        unrouted = send(url, None, "doc0-q1", {"messages": []})
    finally:
        server.shutdown()
    assert routed.error == "" and routed.text == "Hello there" and routed.ttft_s > 0
    assert (routed.prompt_tokens, routed.cached_tokens, routed.output_tokens) == (40, 32, 2)
    assert routed.route == {"replica": "r1", "reason": "events", "expected_from": {"store": 96}}
    assert unrouted.route == {} and unrouted.text == "Hello there"


def test_our_router_s_figures_are_read_from_the_front_end_with_its_token_and_shown_per_way():
    """`front_end_figures` against a real HTTP server answering the front end's router route
    only with the token: the first router's stats, None without the token or where no route
    answers; `router_lines` shows a line for the way our router routed, none for another."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tiered_cache.bench.serve.client import front_end_figures
    from tiered_cache.bench.serve.report import router_lines
    from tiered_cache.workers.names import ROUTER_STATS_PATH

    stats = {"routed": {"r1": 13, "r2": 11}, "fallbacks": 2, "holds": 10, "expired_holds": 1, "full_passed": 3,
             "asked_again": 4,
             "estimate": {"samples": 20, "prefill_s_per_token": 6.5e-3, "cached_share": 0.3,
                          "store_s_per_token": 4e-5}}

    class FrontEnd(BaseHTTPRequestHandler):
        def do_GET(self):
            known = self.path == ROUTER_STATS_PATH and self.headers.get("authorization") == "Bearer t0k"
            body = json.dumps({"routers": [stats], "retried": {}}).encode() if known else b"{}"
            self.send_response(200 if known else 401)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), FrontEnd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        assert front_end_figures(url, "t0k") == stats
        assert front_end_figures(url, "wrong") is None
        assert front_end_figures(url, None) is None
    finally:
        server.shutdown()
        server.server_close()
    ours, theirs = WayRun("d", router=stats), WayRun("b")
    (line,) = router_lines([theirs, ours])
    assert line.startswith("d: routed 13 / 11 per replica; 2 by the fallback; 10 held for the store (1 expired); "
                           "3 passed a full replica over, 4 asked for again")
    assert "prefill 6.50 ms/token" in line and "30% of it" in line and "store 40 us/token (from TTFTs)" in line
    timed = {**stats, "estimate": {**stats["estimate"], "store_timed": True}}
    assert "store 40 us/token (as the replicas timed their loads)" in router_lines([WayRun("d", router=timed)])[0]


def test_engine_arguments_reach_every_vllm_replica_and_a_malformed_one_is_a_one_line_error(capsys):
    """`--engine-arg NAME=VALUE` (VALUE as JSON where it parses) goes into every vLLM way's engine
    arguments, over the app's own (a CPU replica's 32-token blocks); a malformed one stops the
    bench before any cluster starts, with one line naming it."""
    import pytest

    pytest.importorskip("ray")
    from tiered_cache.bench.serve.bench import ServeBenchSettings, _config, engine_arg
    from tiered_cache.cli.main import main
    from tiered_cache.workers.serve_llm.app import engine_args

    assert engine_arg("block_size=128") == ("block_size", 128)
    assert engine_arg(" kv_cache_dtype = fp8") == ("kv_cache_dtype", "fp8")  # not JSON: a string
    assert engine_arg('limit_mm_per_prompt={"image": 0}') == ("limit_mm_per_prompt", {"image": 0})
    workload = ServeWorkload(1, 1, 100, 0, 1, 1.0, 0)
    given = engine_args(_config(ServeBenchSettings(workload, engine_kwargs={"block_size": 128})), [])
    assert given["block_size"] == 128 and given["enable_prompt_tokens_details"] is True
    assert engine_args(_config(ServeBenchSettings(workload)), [])["block_size"] == 32

    assert main(["bench", "serve", "--engine-arg", "block_size"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bench serve: an engine argument is NAME=VALUE (e.g. block_size=128), got 'block_size'"]
