"""The one check of a chat's messages (`[{"role": ..., "content": ...}, ...]`), shared by the
model's chat template (hf_models.py), the cluster's router and its HTTP front end. No torch: the
front end checks a request before anything heavy runs."""

from __future__ import annotations

from typing import Any


def checked_messages(messages: Any) -> list[dict[str, str]]:
    """`messages` as plain {role, content} dicts (other keys dropped); ValueError names the first
    thing wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}] must be an object with string role and content")
    return [{"role": m["role"], "content": m["content"]} for m in messages]
