"""KV sizing calculator: bytes per token and request, what fits on a GPU, what paging saves.

Pure arithmetic on `KVSpec`; `tiered-cache size` prints it. All byte figures are exact integers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tiered_cache.model.spec import KVSpec
from tiered_cache.model.units import format_binary, parse_size


@dataclass(frozen=True)
class RequestMix:
    """Request lengths (tokens) and their shares of traffic; shares are normalised to sum to 1."""

    lengths: tuple[int, ...]
    shares: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.lengths or len(self.lengths) != len(self.shares):
            raise ValueError("a request mix needs one share per length and at least one length")
        if any(n <= 0 for n in self.lengths) or any(s < 0 for s in self.shares) or sum(self.shares) <= 0:
            raise ValueError(f"request lengths must be positive and shares non-negative: {self}")
        total = sum(self.shares)
        object.__setattr__(self, "shares", tuple(s / total for s in self.shares))

    @classmethod
    def parse(cls, text: str) -> RequestMix:
        """`512:50%,2048:30%,8192:20%`, `512:5,2048:3` (weights) or `512,2048` (equal shares)."""
        lengths, shares, percents = [], [], []
        for part in filter(None, (p.strip() for p in text.split(","))):
            length, _, share = part.partition(":")
            percents.append(share.strip().endswith("%"))
            try:
                lengths.append(int(length.replace("_", "")))
                shares.append(float(share.strip().rstrip("%")) if share else 1.0)
            except ValueError:
                raise ValueError(f"cannot read request mix entry {part!r}; expected LENGTH[:SHARE]") from None
        if any(percents):  # percentages must say what they mean; plain weights are normalised
            if not all(percents):
                raise ValueError(f"request mix {text!r}: give every share as a percentage, or none")
            if abs(sum(shares) - 100) > 0.5:
                raise ValueError(f"request mix {text!r}: the shares add up to {sum(shares):g}%, not 100%")
        return cls(tuple(lengths), tuple(shares))

    @classmethod
    def default_for(cls, context: int) -> RequestMix:
        """A chat-like mix: most requests are far shorter than the longest one admitted."""
        lengths = (max(1, context // 8), max(1, context // 4), max(1, context // 2), context)
        return cls(lengths, (0.4, 0.3, 0.2, 0.1))

    def describe(self) -> str:
        return ", ".join(f"{n:,}:{s:.0%}" for n, s in zip(self.lengths, self.shares, strict=True))


@dataclass(frozen=True)
class SizingReport:
    model: str
    spec: dict[str, Any]
    context: int
    bytes_per_token: int
    bytes_per_page: int
    bytes_per_request: int
    pages_per_request: int
    gpu_memory: int
    num_gpus: int
    memory_utilisation: float
    usable_memory: int
    weight_bytes: int
    fits: bool
    min_gpus: int
    kv_budget: int
    tokens_fit: int
    pages_fit: int
    requests_fit: int
    mix: str
    mean_request_tokens: float
    prealloc_bytes_per_request: int
    paged_bytes_per_request: float
    paged_waste_tokens_per_request: float
    paging_saving: float
    prealloc_concurrency: int
    paged_concurrency: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def size_report(spec: KVSpec, *, context: int, weight_bytes: int, gpu_memory: int | str = "80GiB",
                num_gpus: int = 1, memory_utilisation: float = 0.9, mix: RequestMix | None = None,
                model: str | None = None) -> SizingReport:
    """Everything `tiered-cache size` prints, for `context`-token requests of `spec`.

    `memory_utilisation` is the share of GPU memory the engine may use for weights and KV (as
    vLLM's `gpu_memory_utilization`); activations and the runtime take the rest. Max-length
    pre-allocation reserves `context` tokens per request; paging reserves whole pages per request.
    """
    if context <= 0:
        raise ValueError(f"context must be a positive number of tokens, got {context}")
    if not 0 < memory_utilisation <= 1:
        raise ValueError(f"memory utilisation must be in (0, 1], got {memory_utilisation}")
    if num_gpus <= 0:
        raise ValueError(f"number of GPUs must be positive, got {num_gpus}")
    mix = mix or RequestMix.default_for(context)
    if max(mix.lengths) > context:
        raise ValueError(f"request mix has a {max(mix.lengths):,}-token request, longer than the "
                         f"context of {context:,} tokens that pre-allocation reserves")
    per_gpu = parse_size(gpu_memory)
    usable = int(per_gpu * num_gpus * memory_utilisation)
    budget = max(0, usable - weight_bytes)
    min_gpus = max(1, math.ceil(weight_bytes / (per_gpu * memory_utilisation)))
    pages_per_request = spec.pages_for_tokens(context)
    page_tokens = [spec.pages_for_tokens(n) * spec.page_size for n in mix.lengths]
    mean_tokens = sum(n * s for n, s in zip(mix.lengths, mix.shares, strict=True))
    mean_paged_tokens = sum(p * s for p, s in zip(page_tokens, mix.shares, strict=True))
    paged_bytes = mean_paged_tokens * spec.bytes_per_token
    prealloc_bytes = spec.bytes_for_tokens(context)
    pages_fit = budget // spec.bytes_per_page
    notes = []
    if usable <= weight_bytes:
        notes.append(f"weights ({format_binary(weight_bytes)}) do not fit in {num_gpus} × "
                     f"{format_binary(per_gpu)} at {memory_utilisation:.0%} ({format_binary(usable)}): "
                     f"use --gpus {min_gpus} or more")
    return SizingReport(
        model=model or spec.model_id,
        spec=spec.to_dict(),
        context=context,
        bytes_per_token=spec.bytes_per_token,
        bytes_per_page=spec.bytes_per_page,
        bytes_per_request=spec.bytes_for_tokens(context),
        pages_per_request=pages_per_request,
        gpu_memory=per_gpu,
        num_gpus=num_gpus,
        memory_utilisation=memory_utilisation,
        usable_memory=usable,
        weight_bytes=weight_bytes,
        fits=usable > weight_bytes,
        min_gpus=min_gpus,
        kv_budget=budget,
        tokens_fit=budget // spec.bytes_per_token,
        pages_fit=pages_fit,
        requests_fit=pages_fit // pages_per_request,
        mix=mix.describe(),
        mean_request_tokens=mean_tokens,
        prealloc_bytes_per_request=prealloc_bytes,
        paged_bytes_per_request=paged_bytes,
        paged_waste_tokens_per_request=mean_paged_tokens - mean_tokens,
        paging_saving=1 - paged_bytes / prealloc_bytes,
        prealloc_concurrency=budget // prealloc_bytes,
        paged_concurrency=int(budget // paged_bytes),
        notes=notes,
    )
