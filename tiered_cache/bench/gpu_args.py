"""The options of `tiered-cache bench gpu` and the names they take. No heavy import here: the CLI
builds its parser from this module without loading torch."""

from __future__ import annotations

import argparse

MODELS = ("llama-3.1-8b", "llama-3-70b", "tiny")  # shapes shipped in tiered_cache/data/models/
REUSE_ROWS = ("device", "host", "disk", "store", "store-noshm", "redis")  # in the table's order
PAGE_SIZE = 16
SUFFIX = 8  # prompt tokens after the prefix: fewer than a page, so the prefix is all that is cached
DEFAULT_TOKENS = {"cuda": "2048,8192,32768", "cpu": "64,256"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=MODELS, default="llama-3.1-8b",
                        help="shape (a shipped config.json, random weights; llama-3-70b is cut to the layers "
                             "that fit); tiny is for CPU tests")
    parser.add_argument("--tokens", help=f"prefix lengths, multiples of {PAGE_SIZE} (default "
                                         f"{DEFAULT_TOKENS['cuda']} on CUDA, {DEFAULT_TOKENS['cpu']} on the CPU)")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default cuda when available")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                        help="weights, compute and KV (default bf16 on CUDA, fp32 on the CPU)")
    parser.add_argument("--state", choices=["serving", "warm"], default="serving",
                        help="serving (default): every round a prefix the reading cache never read, into a pool of "
                             "--pool-prefixes prefixes kept full; warm: one prefix read again by a cache with room")
    parser.add_argument("--pool-prefixes", type=int, default=8,
                        help="serving: the prefixes a reading cache's pool holds (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per row, each from the same state")
    parser.add_argument("--rows", help=f"reuse rows beside recompute (always run), comma-separated: "
                                       f"{','.join(REUSE_ROWS)} (default all; redis only where redis-server "
                                       "is installed)")
