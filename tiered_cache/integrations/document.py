"""The long text the demo, the real-KV benchmarks and the tests read (shipped as package data,
`data/document.txt`), and what they make of it: a chat prompt about it, SmolLM2's KV of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tiered_cache.integrations.smollm2 import load_model


def document() -> str:
    """The long text the demo and the real-KV benchmarks read (shipped as package data)."""
    return (Path(__file__).resolve().parent.parent / "data" / "document.txt").read_text()


@torch.inference_mode()
def sample_kv(num_tokens: int = 1024) -> torch.Tensor:
    """Real KV (fp16) of the first `num_tokens` tokens of the shipped document."""
    from tiered_cache.integrations.transformers import kv_of_cache

    model, tokenizer = load_model()
    ids = tokenizer(document(), return_tensors="pt").input_ids[:, :num_tokens]
    out = model(ids, use_cache=True)
    return kv_of_cache(out.past_key_values).half()


def chat_prompt(tokenizer: Any, question: str, text: str | None = None) -> list[int]:
    """Token ids of a chat turn asking `question` about `text` (the document by default). The
    document comes first, so prompts about the same document share a long token prefix."""
    content = f"{document() if text is None else text}\n\nQuestion: {question}\nAnswer in one sentence."
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
