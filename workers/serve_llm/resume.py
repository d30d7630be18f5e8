"""`Transcript`: a streamed answer the front end can finish on another replica when its own dies
mid-way.

The front end asks the engine for the token ids beside the text (vLLM's `return_token_ids`; the
client sees them only if it asked) and keeps them. When the replica dies after the first chunk,
the rest is asked of a live one as a completion whose prompt is the prompt's token ids and the
answer's so far, for the tokens left: greedy decoding gives the tokens the dead replica would have
given, and the store holds most of that prefix (the dead replica's connector saved its blocks).
The continuation's chunks are rewritten into the first stream's shape (its id, a chat's deltas,
usage counted over the whole answer), so the client reads one stream.

A stream is resumed only where the token ids tell the whole answer: one choice, no stop strings
(their text is held back behind the tokens), no logprobs, no structured output, no tools, no echo.
Anything else fails as before when its replica dies. Exact for greedy decoding; a sampled answer
goes on as a valid sample, not the one the dead replica would have drawn (the request's generator
starts again), and frequency and presence penalties count only the tokens after the cut (the rest
is prompt to the live replica).
"""

from __future__ import annotations

import json
from typing import Any

# A continuation's max_tokens where the answer had none: vLLM bounds it by the context left (a
# completion's None would mean 16).
UNBOUNDED = 2**31 - 1
# Fields a continuation (a completion request) takes from the original body as they are.
_CARRIED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty",
            "presence_penalty", "repetition_penalty", "stop_token_ids", "ignore_eos", "logit_bias",
            "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids", "bad_words",
            "cache_salt", "priority", "user")


class Transcript:
    """What one streamed answer has said so far, and how to ask for the rest."""

    def __init__(self, body: Any, chat: bool) -> None:
        self.body = body
        self.chat = chat
        self.show_ids = bool(getattr(body, "return_token_ids", False))  # the client asked for them
        self.prompt_ids: list[int] | None = None
        self.output_ids: list[int] = []
        self.head: dict[str, Any] = {}  # the first stream's id, object, created, model
        self.resumable = True  # false once a chunk says text without its token ids
        self.finished = False
        self.continued = 0  # continuations asked

    @classmethod
    def of(cls, body: Any, call_method: str) -> Transcript | None:
        """A transcript for a streamed chat or completion that can be resumed; None otherwise."""
        if call_method not in ("chat", "completions") or not getattr(body, "stream", False):
            return None
        chat = call_method == "chat"
        if (getattr(body, "n", 1) or 1) != 1 or getattr(body, "stop", None) or getattr(body, "logprobs", None) \
                or getattr(body, "echo", False) or getattr(body, "use_beam_search", False) \
                or getattr(body, "structured_outputs", None) or getattr(body, "tools", None) \
                or getattr(getattr(body, "response_format", None), "type", "text") != "text":
            return None
        if not chat and not isinstance(getattr(body, "prompt", None), str) and not _is_ids(body.prompt):
            return None  # a batch of prompts
        return cls(body, chat)

    def asked(self) -> Any:
        """The original body with the token ids asked for."""
        return self.body if self.show_ids else self.body.model_copy(update={"return_token_ids": True})

    def passed(self, response: Any) -> Any:
        """A stream item (a string of SSE events, or a list of them) as the client should read it:
        recorded, the token ids the client did not ask for removed, a continuation's events in the
        first stream's shape. Anything else (an error object) passes as it is."""
        if isinstance(response, list) and response and all(isinstance(r, str) for r in response):
            return [self._event(e) for r in response for e in _events(r)]
        if isinstance(response, str):
            return "".join(self._event(e) for e in _events(response))
        return response

    def _event(self, event: str) -> str:
        if not event.startswith("data:") or event[5:].strip() == "[DONE]":
            return event
        try:
            chunk = json.loads(event[5:])
        except ValueError:
            self.resumable = False
            return event
        if not isinstance(chunk, dict):
            return event
        if self.continued:
            chunk = self._as_first(chunk)
        else:
            self.head = self.head or {k: chunk.get(k) for k in ("id", "object", "created", "model")}
        self._record(chunk)
        if self.show_ids and not self.continued:
            return event  # the client reads it as the engine wrote it
        if not self.show_ids:
            chunk.pop("prompt_token_ids", None)
            for choice in chunk.get("choices") or ():
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
        return f"data: {json.dumps(chunk, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def _record(self, chunk: dict[str, Any]) -> None:
        prompt = chunk.get("prompt_token_ids")
        for choice in chunk.get("choices") or ():
            prompt = prompt or choice.get("prompt_token_ids")
            ids = choice.get("token_ids")
            text = choice.get("text") if not self.chat else (choice.get("delta") or {}).get("content")
            if ids is None and text:
                self.resumable = False
            self.output_ids.extend(ids or ())
            self.finished = self.finished or choice.get("finish_reason") is not None
        if prompt and self.prompt_ids is None and not self.continued:
            self.prompt_ids = list(prompt)

    def _as_first(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A continuation's completion chunk in the first stream's shape."""
        out: dict[str, Any] = {**chunk, **{k: v for k, v in self.head.items() if v is not None}}
        out.pop("prompt_token_ids", None)
        choices = []
        for choice in chunk.get("choices") or ():
            choice = {k: v for k, v in choice.items() if k != "prompt_token_ids"}
            if self.chat:
                text = choice.pop("text", "")
                choice["delta"] = {"content": text} if text else {}
            choices.append(choice)
        out["choices"] = choices
        usage = chunk.get("usage")
        if usage and self.prompt_ids is not None:
            prompt, said = len(self.prompt_ids), int(usage.get("prompt_tokens") or 0) - len(self.prompt_ids)
            completion = said + int(usage.get("completion_tokens") or 0)
            out["usage"] = {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
                            "total_tokens": prompt + completion}
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                out["usage"]["prompt_tokens_details"] = {**details,
                                                         "cached_tokens": min(prompt, int(details["cached_tokens"]))}
        return out

    def can_resume(self) -> bool:
        return self.resumable and not self.finished and self.prompt_ids is not None

    def continuation(self) -> Any:
        """The completion request for the rest of the answer (call `can_resume` first)."""
        from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest

        assert self.prompt_ids is not None
        data = self.body.model_dump(exclude_unset=True)
        fields = {k: data[k] for k in _CARRIED if k in data}
        limits = self.body.model_dump(include={"max_completion_tokens", "max_tokens"})  # read without a warning
        limit = limits.get("max_completion_tokens") or limits.get("max_tokens")
        said = len(self.output_ids)
        fields.update(prompt=self.prompt_ids + self.output_ids, stream=True, return_token_ids=True,
                      max_tokens=UNBOUNDED if limit is None else max(1, int(limit) - said),
                      min_tokens=max(0, int(data.get("min_tokens") or 0) - said),
                      stream_options=data.get("stream_options") or {"include_usage": False})
        self.continued += 1
        return CompletionRequest(**fields)


def _events(text: str) -> list[str]:
    """SSE events of a string ("data: ...\\n\\n" each), each with its blank line."""
    return [e + "\n\n" for e in text.split("\n\n") if e.strip()]


def _is_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)
