"""Draw a `TieredCache.prefix_tree()` snapshot in the terminal: shared prefixes as branches, each node's
pages and tokens, where its pages are, hits, idle time and a preview of its text (or token ids)."""

from __future__ import annotations

from typing import Any

from tiered_cache.model.units import format_binary
from tiered_cache.tiers.base import Tier

PREVIEW_CHARS = 36


def _clip(text: str, tail: bool) -> str:
    flat = " ".join(text.split())  # newlines and runs of spaces as one space
    if len(flat) <= PREVIEW_CHARS:
        return flat
    return "…" + flat[-PREVIEW_CHARS:] if tail else flat[:PREVIEW_CHARS] + "…"


def _preview(node: dict[str, Any]) -> str:
    if node.get("head_text") is not None:
        head, tail = _clip(node["head_text"], False), _clip(node.get("tail_text") or "", True)
        if node.get("head_skipped_tokens"):  # where it parts from its siblings
            head = "…" + head
        return f'"{head}"' if node["pages"] == 1 else f'"{head}" … "{tail}"'
    ids = node.get("head_tokens")
    if ids:
        return f"tokens {ids[:6]}…"
    return "(tokens not remembered)"


def _idle(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"


def _line(node: dict[str, Any]) -> str:
    pages = f"{node['pages']:,} page{'s' if node['pages'] != 1 else ''} ({node['tokens']:,} tokens)"
    held = " · in use" if node.get("in_use") else ""
    return (f"{pages} · {'+'.join(node['where'])} · hits {node['hits']:,} · idle {_idle(node['idle_s'])}{held}  "
            f"{_preview(node)}")


def reuse_line(reuse: dict[str, Any] | None) -> str:
    """One line on the reuse policy (`ReuseStats.to_dict()`): what it plans with and what it
    skipped. Empty without figures (an older cache)."""
    if not reuse:
        return ""
    prefill = reuse.get("prefill_tokens_per_s")
    measured = reuse.get("prefill_measured") or {}
    how = "set" if reuse.get("prefill_configured") else (
        f"measured: {measured['basis']} over {measured['forwards']} forward(s), throughput "
        f"{measured['throughput_tokens_per_s']:,.0f} tokens/s" if measured else "measured")
    said = f"prefill {prefill:,.0f} tokens/s ({how})" if prefill else \
        "prefill rate not known yet: everything found is loaded"
    rates = ", ".join(f"{tier} {format_binary(r['bytes_per_s'])}/s"
                      + (f" + {1e3 * r['latency_s']:.1f} ms" if r["latency_s"] >= 5e-5 else "")
                      + (f" (seen up to {format_binary(r['known_up_to_bytes'])})"
                         if r.get("known_up_to_bytes") is not None else "")
                      for tier, r in reuse.get("load_rates", {}).items())
    skipped = reuse.get("skipped_pages", {})
    left = (f"{sum(skipped.values()):,} pages left to recompute ("
            + ", ".join(f"{t} {n:,}" for t, n in skipped.items()) + ")") if skipped else "no page skipped"
    return f"reuse {reuse['policy']}: {said}; load {rates or 'not measured yet'}; {left}"


def canary_line(canary: dict[str, Any] | None) -> str:
    """One line on the correctness canary (`CanaryStats.to_dict()`); empty when it is off."""
    if not canary or not canary.get("fraction"):
        return ""
    quarantined = "; ".join(f"{ns or '(default)'}: {', '.join(tiers)}" for ns, tiers in canary["quarantined"].items())
    return (f"canary: {canary['fraction']:.0%} of hits recomputed; {canary['checks']:,} checked, "
            f"{canary['mismatches']:,} wrong ({canary['pages_wrong']:,} pages), {canary['dropped']:,} dropped while "
            f"busy; quarantined: {quarantined or 'none'}")


def render_tree(view: dict[str, Any], title: str = "") -> str:
    lines = [title] if title else []
    tiers = view.get("tiers", {})
    below = ", ".join(f"{name} {pages:,}" for name, pages in tiers.items() if name != Tier.DEVICE and pages)
    for ns in view["namespaces"]:
        name = ns["namespace"] or "(default)"
        lines.append(f"namespace {name}: {len(ns['children'])} branch{'es' if len(ns['children']) != 1 else ''} "
                     f"from the root")
        stack = [(child, "", i == len(ns["children"]) - 1) for i, child in enumerate(ns["children"])][::-1]
        while stack:
            node, indent, last = stack.pop()
            lines.append(f"{indent}{'└── ' if last else '├── '}{_line(node)}")
            inner = indent + ("    " if last else "│   ")
            kids = node["children"]
            stack.extend([(child, inner, i == len(kids) - 1) for i, child in enumerate(kids)][::-1])
    if not view["namespaces"]:
        lines.append("(the tree is empty: nothing on the device)")
    if view.get("truncated"):
        lines.append(f"(only the largest branches shown: the tree has {view['nodes']:,} nodes; raise --max-nodes)")
    if below:
        lines.append(f"pages per tier (the tree holds the device's; host RAM and below hold pages by key): {below}")
    if reuse := reuse_line(view.get("reuse")):
        lines.append(reuse)
    return "\n".join(lines)
