"""An engine's speculative counters: read a snapshot (vLLM's /metrics, the local server's /stats),
diff two snapshots, and turn the difference into acceptance (tau and per-position rates)."""

from __future__ import annotations

import re

import httpx

VLLM_SPEC_METRICS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def read_counters(engine: str, base_url: str, timeout_s: float = 30, headers=None) -> dict:
    """A snapshot of the engine's cumulative speculative counters (diff two snapshots per job)."""
    if engine == "vllm":
        reply = httpx.get(base_url + "/metrics", timeout=timeout_s, headers=headers)
        return parse_vllm_metrics(reply.text)
    if engine == "local":
        return httpx.get(base_url + "/stats", timeout=timeout_s, headers=headers).json()
    return {}  # SGLang reports acceptance per request (meta_info)


def parse_vllm_metrics(text: str) -> dict:
    """Spec-decode counters from vLLM's Prometheus text, summed over label sets:
    {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos": [...]}."""
    counters = {name: 0.0 for name in VLLM_SPEC_METRICS}
    per_pos: dict[int, float] = {}
    pattern = re.compile(r"^vllm:spec_decode_(\w+?)_total(?:\{(.*)\})?\s+(\S+)")
    for line in text.splitlines():
        match = pattern.match(line)
        if not match:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if name in counters:
            counters[name] += value
        elif name == "num_accepted_tokens_per_pos":
            pos = int(re.search(r'position="(\d+)"', labels).group(1))
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    counters["accepted_per_pos"] = [per_pos[p] for p in sorted(per_pos)]
    return counters


def counter_delta(before: dict, after: dict) -> dict:
    """after - before for numbers and (element-wise, zero-padded) lists."""
    delta = {}
    for key, value in after.items():
        old = before.get(key, 0)
        if isinstance(value, list):
            old = list(old or [])
            old += [0] * (len(value) - len(old))
            delta[key] = [a - b for a, b in zip(value, old)]
        elif isinstance(value, (int, float)):
            delta[key] = value - (old or 0)
    return delta


def acceptance_from_counters(delta: dict) -> dict:
    """tau (tokens per verify step, the bonus token included) and per-position acceptance rates
    from a vLLM-style counter delta."""
    drafts = delta.get("num_drafts", 0)
    if not drafts:
        return {}
    accepted = delta["num_accepted_tokens"]
    return {
        "accept_length": 1 + accepted / drafts,
        "num_drafts": drafts,
        "accept_per_pos": [n / drafts for n in delta.get("accepted_per_pos", [])],
        "draft_acceptance_rate": accepted / max(delta["num_draft_tokens"], 1),
    }
