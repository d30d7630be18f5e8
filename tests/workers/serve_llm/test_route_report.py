"""What an answer's `tiered_cache` field says of its route (`route_report`): the replica chosen,
what the router expected there, and the best scored of the replicas it passed over."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray.serve.llm")

from tiered_cache.workers.routing.policy import Considered, Decision
from tiered_cache.workers.serve_llm.request_router import OTHERS_SHOWN, route_report


def test_a_route_shows_the_chosen_replica_and_the_best_scored_of_those_passed_over():
    weighed = [Considered("r2", 0.5, 0.1, (0, 0, 512), 0.6)]  # chosen: it loads the prefix from the store
    weighed += [Considered(f"r{i}", 4.0 + i, 3.0 + i, (512, 0, 0), 4.5 + i) for i in range(6, 2, -1)]
    weighed += [Considered("r1", 2.0, 1.5, (256, 0, 256), 2.5)]
    decision = Decision("r2", "events", 512, (0, 0, 512), wait_s=0.1, considered=tuple(weighed))
    report = route_report(decision)
    assert report["replica"] == "r2" and report["expected_from"] == {"device": 0, "host": 0, "store": 512}
    assert (report["expected_ttft_ms"], report["score_ms"], report["expected_wait_ms"]) == (500, 600, 100)
    assert list(report["others"]) == ["r1", "r3", "r4"][:OTHERS_SHOWN]  # best scored first, not every replica
    assert report["others"]["r1"] == {"expected_from": {"device": 256, "host": 0, "store": 256},
                                      "expected_wait_ms": 1500, "expected_ttft_ms": 2000, "score_ms": 2500}


def test_a_route_decided_without_events_says_only_where_and_why():
    assert route_report(Decision("r1", "least_cached", 0)) == {"replica": "r1", "reason": "least_cached"}


def test_the_first_token_is_seen_in_the_chunk_ray_batches_it_into_beside_the_role():
    """Ray Serve LLM batches a stream's events into one chunk (its `_openai_json_wrapper`): the
    first chunk holds the role's event (empty content) and the first token's together. The front
    end tells the router of the first token at that chunk, not one engine step later; a chunk
    with the role alone, or only usage, carries none."""
    import asyncio
    import json

    from ray.llm._internal.serve.core.ingress.utils import _openai_json_wrapper
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
    )
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse

    from tiered_cache.workers.serve_llm.ingress import has_token

    def chat(**delta) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(model="m", choices=[ChatCompletionResponseStreamChoice(
            index=0, delta=DeltaMessage(**delta))])

    async def chunks(batches) -> list[str]:
        async def stream():
            for batch in batches:
                yield batch
        return [c async for c in _openai_json_wrapper(stream())]

    role, first, usage_only = asyncio.run(chunks([[chat(role="assistant", content="")],
                                                   [chat(role="assistant", content=""), chat(content="Hello")],
                                                   [ChatCompletionStreamResponse(model="m", choices=[])]]))[:3]
    assert '"content":""' in first.replace(" ", "")  # the batch Ray makes: role and token in one chunk
    assert has_token(first) and not has_token(role) and not has_token(usage_only)
    text = asyncio.run(chunks([[CompletionStreamResponse(model="m", choices=[CompletionResponseStreamChoice(
        index=0, text=" Paris")])]]))[0]
    assert has_token(text) and not has_token("data: [DONE]\n\n") and not has_token("data: {not json\n\n")
    tool = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}}]}
    assert has_token(f"data: {json.dumps(tool)}\n\n")  # a tool call's first token is a token too
