"""A stream whose replica died mid-way, finished by a live one (`resume.Transcript`): the events
are vLLM's own response objects as its streaming server writes them, the request bodies Ray Serve
LLM's. The engine test (a replica killed under a stream) is in test_serve_vllm.py."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray.serve.llm")

from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, CompletionRequest
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse
from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

from tiered_cache.workers.serve_llm.resume import Transcript

PROMPT = [1, 9, 8, 7, 6, 5]


def chat_body(**extra) -> ChatCompletionRequest:
    fields = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell a story."}], "stream": True,
              "stream_options": {"include_usage": True}, "max_completion_tokens": 10, "temperature": 0,
              "cache_salt": "tenant-a"}
    return ChatCompletionRequest(**{**fields, **extra})


def event(response) -> str:
    return f"data: {response.model_dump_json(exclude_unset=False)}\n\n"


def chat_chunk(content: str | None, ids: list[int] | None, *, first: bool = False, finish: str | None = None):
    delta = DeltaMessage(role="assistant", content="") if first else DeltaMessage(content=content)
    return ChatCompletionStreamResponse(
        id="chatcmpl-1", created=100, model="smollm2", prompt_token_ids=PROMPT if first else None,
        choices=[ChatCompletionResponseStreamChoice(index=0, delta=delta, finish_reason=finish,
                                                    token_ids=None if first else ids)])


def completion_chunk(text: str, ids: list[int], prompt: list[int] | None = None, finish: str | None = None,
                     usage: UsageInfo | None = None):
    choices = [CompletionResponseStreamChoice(index=0, text=text, finish_reason=finish, token_ids=ids,
                                              prompt_token_ids=prompt)] if usage is None else []
    return CompletionStreamResponse(id="cmpl-2", created=200, model="smollm2", choices=choices, usage=usage)


def data(events: str) -> list[dict]:
    return [json.loads(e[5:]) for e in events.split("\n\n") if e.startswith("data:") and "[DONE]" not in e]


def test_a_chat_stream_cut_mid_way_is_asked_for_the_rest_by_token_ids_and_read_as_one_stream():
    body = chat_body()
    transcript = Transcript.of(body, "chat")
    assert transcript is not None
    asked = transcript.asked()
    assert asked.return_token_ids and not body.return_token_ids  # the engine says the ids, the client did not ask
    # Ray Serve LLM batches a replica's events in lists of strings.
    first = transcript.passed([event(chat_chunk(None, None, first=True)), event(chat_chunk("Once", [41]))])
    said = transcript.passed(event(chat_chunk(" upon", [42, 43])))
    seen = data("".join(first) + said)
    assert [c["choices"][0]["delta"].get("content") for c in seen] == ["", "Once", " upon"]
    assert all("prompt_token_ids" not in c and "token_ids" not in c["choices"][0] for c in seen)
    assert transcript.can_resume()

    rest = transcript.continuation()
    assert isinstance(rest, CompletionRequest)
    assert rest.prompt == PROMPT + [41, 42, 43]  # the answer so far is part of the prompt
    assert rest.max_tokens == 10 - 3 and rest.stream and rest.return_token_ids
    assert rest.cache_salt == "tenant-a" and rest.temperature == 0  # same KV namespace, same decoding
    assert rest.stream_options.include_usage

    usage = UsageInfo(prompt_tokens=len(PROMPT) + 3, completion_tokens=2, total_tokens=len(PROMPT) + 5,
                      prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=8))
    tail = transcript.passed([event(completion_chunk(" a", [44], prompt=PROMPT + [41, 42, 43])),
                              event(completion_chunk(" time", [45], finish="length")),
                              event(completion_chunk("", [], usage=usage)), "data: [DONE]\n\n"])
    assert tail[-1] == "data: [DONE]\n\n"
    rewritten = data("".join(tail))
    assert {(c["id"], c["object"], c["created"]) for c in rewritten} == {("chatcmpl-1", "chat.completion.chunk", 100)}
    assert [c["choices"][0]["delta"].get("content") for c in rewritten[:2]] == [" a", " time"]
    assert rewritten[1]["choices"][0]["finish_reason"] == "length"
    assert all("text" not in ch and "token_ids" not in ch for c in rewritten for ch in c["choices"])
    # Usage over the whole answer: the prompt the client sent, every token generated.
    assert rewritten[2]["usage"]["prompt_tokens"] == len(PROMPT)
    assert rewritten[2]["usage"]["completion_tokens"] == 5 and rewritten[2]["usage"]["total_tokens"] == len(PROMPT) + 5
    assert rewritten[2]["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT)
    assert transcript.output_ids == [41, 42, 43, 44, 45] and not transcript.can_resume()  # finished


def test_a_second_death_resumes_from_everything_said_and_a_client_asking_for_ids_keeps_them():
    body = ChatCompletionRequest(model="smollm2", messages=[{"role": "user", "content": "Once"}], stream=True,
                                 return_token_ids=True, min_tokens=4)  # no limit: up to the context
    transcript = Transcript.of(body, "chat")
    assert transcript is not None and transcript.asked() is body
    kept = data(transcript.passed(event(completion_chunk(" upon", [7], prompt=PROMPT))))
    assert kept[0]["choices"][0]["token_ids"] == [7] and kept[0]["choices"][0]["prompt_token_ids"] == PROMPT
    first_rest = transcript.continuation()
    assert first_rest.max_tokens >= 2**31 - 1 and first_rest.min_tokens == 3
    transcript.passed(event(completion_chunk(" a", [8], prompt=PROMPT + [7])))
    second_rest = transcript.continuation()
    assert second_rest.prompt == PROMPT + [7, 8] and second_rest.min_tokens == 2


@pytest.mark.parametrize("extra", [{"stop": ["\n"]}, {"n": 2}, {"logprobs": True},
                                   {"stream": False, "stream_options": None}])
def test_a_stream_whose_ids_do_not_tell_the_whole_answer_is_not_resumed(extra):
    assert Transcript.of(chat_body(**extra), "chat") is None
    assert Transcript.of(chat_body(), "embeddings") is None


def test_text_without_its_token_ids_or_before_the_prompt_s_ids_cannot_be_resumed():
    transcript = Transcript.of(chat_body(), "chat")
    assert transcript is not None and not transcript.can_resume()  # nothing said yet: sent again whole
    transcript.passed(event(chat_chunk(None, None, first=True)))
    assert transcript.can_resume()
    transcript.passed(event(chat_chunk("hidden", None)))  # an engine that hides the ids (a reasoning parser)
    assert not transcript.can_resume()
    error = object()
    assert transcript.passed(error) is error  # an error object passes untouched
