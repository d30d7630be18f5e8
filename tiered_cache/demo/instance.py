"""One inference instance of the demo, in its own process. Prints progress to stderr and one JSON
line of results to stdout.

    python -m tiered_cache.demo.instance a STORE_ADDRESS [--repeat N]   # computes the document's KV, answers Q1
    python -m tiered_cache.demo.instance b STORE_ADDRESS [--repeat N]   # empty cache: loads it, answers Q2

Each TTFT is measured N times (default 3) after one warm-up forward, each time from the same
state (host RAM refilled by an eviction, a fresh empty cache for the store), so the report can
print the median and the spread instead of one number a busy machine can swing many-fold.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

QUESTIONS = {
    "a": "In what year was the lighthouse's lamp first lit?",
    "b": "In what year was the light automated?",
}
MAX_NEW_TOKENS = 48


def say(message: str) -> None:
    print(f"  [{sys.argv[1].upper()}] {message}", file=sys.stderr, flush=True)


def _row(label: str, result: Any, tokenizer: Any, more_ttft_s: Sequence[float] = ()) -> dict[str, Any]:
    """One run's figures; `ttft_s` is the median over this run and the repeats in `more_ttft_s`,
    `ttft_runs_s` all of them."""
    data = asdict(result)
    data.pop("first_logits")
    runs = [result.ttft_s, *more_ttft_s]
    return {"label": label, **data, "ttft_s": statistics.median(runs), "ttft_runs_s": runs,
            "answer": tokenizer.decode(result.tokens, skip_special_tokens=True).strip()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one instance of `tiered-cache demo`")
    p.add_argument("role", choices=sorted(QUESTIONS))
    p.add_argument("address", help="the store server's HOST:PORT")
    p.add_argument("--repeat", type=int, default=3, help="TTFT runs per row (default 3)")
    p.add_argument("--doc-chars", type=int, default=None, help="leading characters of the document (default all)")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                   help=f"tokens of each answer (default {MAX_NEW_TOKENS})")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    role, address, repeat, max_new = args.role, args.address, args.repeat, args.max_new_tokens
    from tiered_cache.cache import TieredCache
    from tiered_cache.config import CacheConfig
    from tiered_cache.integrations.document import chat_prompt, document
    from tiered_cache.integrations.smollm2 import load_model
    from tiered_cache.integrations.transformers import generate, spec_for
    from tiered_cache.tiers.base import Tier

    say("loading SmolLM2-135M-Instruct (fp32 compute, fp16 KV) ...")
    model, tokenizer = load_model()
    spec = spec_for(model, "fp16", model_id="HuggingFaceTB/SmolLM2-135M-Instruct")
    config = CacheConfig(pool_capacity="256MiB", host_capacity="512MiB", lower_tiers=[Tier.REMOTE],
                         remote_addresses=[address], write_policy="write_through")
    cache = TieredCache(spec, config)
    text = None if args.doc_chars is None else document()[:args.doc_chars]
    prompt = chat_prompt(tokenizer, QUESTIONS[role], text)
    eos = tokenizer.eos_token_id

    def ttft(use: Any) -> float:  # one more TTFT from the same state: the first token only
        return generate(model, prompt, use, 1, eos).ttft_s

    # Warm-up: first-call allocations, at this prompt's size (not the whole document's).
    generate(model, prompt, None, 1, eos)
    rows = []
    say(f"prompt: {len(prompt):,} tokens (the document, then the question); each TTFT {repeat} times")
    say("answering without any cache (full prefill) ...")
    first = generate(model, prompt, None, max_new, eos)
    rows.append(_row("no cache", first, tokenizer, [ttft(None) for _ in range(repeat - 1)]))
    if role == "a":
        say("answering with the cache: nothing cached yet, so it prefills and stores the pages ...")
        rows.append(_row("cold cache (computes, stores)", generate(model, prompt, cache, max_new, eos),
                         tokenizer))
        moved = cache.evict()
        say(f"moved {moved} pages from the device pool to host RAM; answering again ...")
        first = generate(model, prompt, cache, max_new, eos)
        more = []
        for _ in range(repeat - 1):
            cache.evict()
            more.append(ttft(cache))
        rows.append(_row("prefix from local host RAM", first, tokenizer, more))
    else:
        say(f"empty local cache; looking the prompt up: {cache.lookup(prompt):,} tokens are in the store")
        first = generate(model, prompt, cache, max_new, eos)
        more = []
        for _ in range(repeat - 1):  # each from a fresh, empty local cache: the store answers again
            with TieredCache(spec, config.replace(write_policy="write_back")) as fresh:
                fresh.warming.join(30)  # an instance that has come up (connected, its memory faulted in)
                more.append(ttft(fresh))
        rows.append(_row("prefix from the remote store", first, tokenizer, more))
    tree = None
    if role == "b":  # A's question too: the document's pages are shared, each question is a leaf
        say("asking instance A's question too, for the radix tree picture ...")
        generate(model, chat_prompt(tokenizer, QUESTIONS["a"], text), cache, 4, eos)
        tree = cache.prefix_tree(decode=tokenizer.decode)
    cache.close()  # finishes the background write-through to the store
    print(json.dumps({"role": role, "question": QUESTIONS[role], "prompt_tokens": len(prompt), "rows": rows,
                      "bytes_per_token": spec.bytes_per_token, "tree": tree}))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the parent says it once
        sys.exit(130)
