"""The HTTP front end's request and response handling, without a cluster (workers/http_frontend.py):
what a request is refused for, the OpenAI shapes it answers in, and the token beyond loopback.
The endpoints themselves, over HTTP against a running cluster, are in the CLI walk
(tests/cli/test_cluster_cli.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from tiered_cache.workers.http_frontend import (
    BadRequest,
    chunk_body,
    deploy,
    parse_body,
    read_request,
    response_body,
    token_refusal,
)

ANSWER = {"tokens": [5, 6, 7], "prompt_tokens": 40, "reused_tokens": 32, "text": "a b c", "worker": "worker-1",
          "sources": {"host": 32}, "ttft_s": 0.01, "route": {"worker": "worker-1", "reason": "prefix"}}


@pytest.mark.parametrize(("raw", "reason"), [(b"", "must be a JSON object"), (b"[1]", "must be a JSON object"),
                                             (b"{'a': 1}", "not JSON"), (b"\xff", "not JSON")])
def test_a_body_that_is_not_a_json_object_is_refused(raw, reason):
    with pytest.raises(BadRequest, match=reason):
        parse_body(raw)


@pytest.mark.parametrize(("body", "chat", "reason"), [
    ({}, False, "prompt must be a non-empty string"),
    ({"prompt": ["a", "b"]}, False, "prompt must be a non-empty string"),
    ({"messages": []}, True, "messages must be a non-empty list"),
    ({"messages": [{"role": "user", "content": 3}]}, True, r"messages\[0\] must be an object"),
    ({"prompt": "x", "max_tokens": 0}, False, "max_tokens must be a positive integer"),
    ({"prompt": "x", "max_tokens": True}, False, "max_tokens must be a positive integer"),
    ({"prompt": "x", "temperature": 1}, False, "temperature must be 0"),
    ({"prompt": "x", "n": 2}, False, "n must be 1"),
    ({"prompt": "x", "stream": "yes"}, False, "stream and cache must be true or false"),
])
def test_a_request_is_refused_naming_the_field_that_is_wrong(body, chat, reason):
    with pytest.raises(BadRequest, match=reason):
        read_request(body, chat)


def test_a_request_reads_as_openai_clients_send_it():
    assert read_request({"prompt": ["hi"], "max_tokens": 3, "temperature": 0.0}, False) == ("hi", 3, False, True)
    messages = [{"role": "user", "content": "hi", "name": "ignored"}]
    assert read_request({"messages": messages, "max_completion_tokens": 7, "stream": True, "cache": False}, True) \
        == ([{"role": "user", "content": "hi"}], 7, True, False)
    assert read_request({"prompt": "x", "max_tokens": None}, False)[1] == 16  # OpenAI's default


def test_answers_carry_openai_usage_with_the_cached_tokens_and_what_the_cache_did():
    body = response_body(ANSWER, "cmpl-1", "smollm2", chat=False, max_tokens=3)
    assert body["choices"] == [{"index": 0, "text": "a b c", "finish_reason": "length", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
                             "prompt_tokens_details": {"cached_tokens": 32}}
    assert body["tiered_cache"]["sources"] == {"host": 32} and body["tiered_cache"]["worker"] == "worker-1"
    chat = response_body(ANSWER, "chatcmpl-1", "smollm2", chat=True, max_tokens=8)
    assert chat["object"] == "chat.completion" and chat["choices"][0]["finish_reason"] == "stop"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "a b c"}
    last = chunk_body("chatcmpl-1", "smollm2", True, "", "stop", body["usage"])
    assert last["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop"}
    assert last["usage"]["total_tokens"] == 43


def test_listening_beyond_loopback_needs_a_token_and_every_request_must_send_it():
    with pytest.raises(ValueError, match="listens beyond loopback: give a token"):
        deploy("ns", "smollm2", host="0.0.0.0", port=8000, token=None)
    token = "s3cret-token-0123456789"
    assert token_refusal(token, f"Bearer {token}") is None
    assert token_refusal(None, "") is None  # loopback, no token set
    for wrong in ("", "Bearer nope", token, f"bearer {token}x"):
        refused = token_refusal(token, wrong)
        assert refused is not None and refused.status_code == 401
