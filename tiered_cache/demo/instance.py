"""One inference instance of the demo, in its own process. Prints progress to stderr and one JSON
line of results to stdout.

    python -m tiered_cache.demo.instance a STORE_ADDRESS   # computes the document's KV, answers Q1
    python -m tiered_cache.demo.instance b STORE_ADDRESS   # empty cache: fetches it, answers Q2
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any

QUESTIONS = {
    "a": "In what year was the lighthouse's lamp first lit?",
    "b": "In what year was the light automated?",
}
MAX_NEW_TOKENS = 48


def say(message: str) -> None:
    print(f"  [{sys.argv[1].upper()}] {message}", file=sys.stderr, flush=True)


def _row(label: str, result: Any, tokenizer: Any) -> dict[str, Any]:
    data = asdict(result)
    data.pop("first_logits")
    return {"label": label, **data, "answer": tokenizer.decode(result.tokens, skip_special_tokens=True).strip()}


def main() -> None:
    role, address = sys.argv[1], sys.argv[2]
    from tiered_cache.cache import TieredCache
    from tiered_cache.config import CacheConfig
    from tiered_cache.integrations.smollm2 import chat_prompt, load_model
    from tiered_cache.integrations.transformers import generate, spec_for

    say("loading SmolLM2-135M-Instruct (fp32 compute, fp16 KV) ...")
    model, tokenizer = load_model()
    spec = spec_for(model, "fp16", model_id="HuggingFaceTB/SmolLM2-135M-Instruct")
    cache = TieredCache(spec, CacheConfig(pool_capacity="256MiB", host_capacity="512MiB", lower_tiers=["remote"],
                                          remote_addresses=[address], write_policy="write_through"))
    prompt = chat_prompt(tokenizer, QUESTIONS[role])
    eos = tokenizer.eos_token_id
    rows = []
    say(f"prompt: {len(prompt):,} tokens (the document, then the question)")
    say("answering without any cache (full prefill) ...")
    rows.append(_row("no cache", generate(model, prompt, None, MAX_NEW_TOKENS, eos), tokenizer))
    if role == "a":
        say("answering with the cache: nothing cached yet, so it prefills and stores the pages ...")
        rows.append(_row("cold cache (computes, stores)", generate(model, prompt, cache, MAX_NEW_TOKENS, eos),
                         tokenizer))
        moved = cache.evict()
        say(f"moved {moved} pages from the device pool to host RAM; answering again ...")
        rows.append(_row("prefix from local host RAM", generate(model, prompt, cache, MAX_NEW_TOKENS, eos),
                         tokenizer))
    else:
        say(f"empty local cache; looking the prompt up: {cache.lookup(prompt):,} tokens are in the store")
        rows.append(_row("prefix from the remote store", generate(model, prompt, cache, MAX_NEW_TOKENS, eos),
                         tokenizer))
    tree = None
    if role == "b":  # A's question too: the document's pages are shared, each question is a leaf
        say("asking instance A's question too, for the radix tree picture ...")
        generate(model, chat_prompt(tokenizer, QUESTIONS["a"]), cache, 4, eos)
        tree = cache.prefix_tree(decode=tokenizer.decode)
    cache.close()  # finishes the background write-through to the store
    print(json.dumps({"role": role, "question": QUESTIONS[role], "prompt_tokens": len(prompt), "rows": rows,
                      "bytes_per_token": spec.bytes_per_token, "tree": tree}))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the parent says it once
        sys.exit(130)
