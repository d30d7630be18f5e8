"""`cluster generate`'s answer line names each route figure for its unit: the event policy's is
prompt tokens expected cached, the prefix policies' characters of the prompt's text matched."""

from tiered_cache.cli.cluster_cmd import render_answer
from tiered_cache.workers.router import _route
from tiered_cache.workers.routing.policy import Decision


def _answer(decision: Decision) -> dict:
    return {"text": "Yes.", "route": _route(decision), "sources": {"device": 2800}, "reused_tokens": 2800,
            "prompt_tokens": 2832, "ttft_s": 0.05}


def test_the_event_policy_s_figure_is_tokens_and_the_prefix_policy_s_characters():
    events = _answer(Decision("worker-0", "events", 2800, (2800, 0, 0)))
    assert events["route"] == {"worker": "worker-0", "reason": "events", "matched_tokens": 2800}
    assert "2,800 tokens expected cached" in render_answer(events) and "chars" not in render_answer(events)
    prefix = _answer(Decision("worker-1", "prefix", 11000))
    assert prefix["route"] == {"worker": "worker-1", "reason": "prefix", "matched_chars": 11000}
    assert "11,000 chars matched" in render_answer(prefix)
