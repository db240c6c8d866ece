"""Measuring one engine: a pass of the suite on a warm engine, the repeats of a job (stopping once
apart from spec=off), and the statistics of a pass (throughput, latency percentiles, acceptance)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

from eagle3.bench.verdict import Spread, combine_repeats
from eagle3.core.common import log
from eagle3.core.config import BenchConfig
from eagle3.core.spec import Spec
from eagle3.serve.counters import acceptance_from_counters, counter_delta
from eagle3.serve.launch import EngineFailed

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def aggregate(records: list[dict], wall_s: float, acceptance: dict) -> dict:
    """Suite-level metrics: throughput, latency percentiles, acceptance, per-step decode time."""
    tokens = sum(r["output_tokens"] for r in records)
    ttfts = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    decode = [(r["latency_s"] - (r["ttft_s"] or 0.0), r["output_tokens"] - 1) for r in records]
    itls = [seconds / n for seconds, n in decode if n > 0]
    decode_tok_s = sum(n for _, n in decode) / max(sum(s for s, _ in decode), 1e-9)
    tau = acceptance.get("accept_length", 1.0)
    metrics = {
        "tokens_per_s": tokens / wall_s,
        "output_tokens": tokens,
        "requests": len(records),
        "wall_s": wall_s,
        "decode_tokens_per_s": decode_tok_s,
        "step_s": tau / decode_tok_s,
        "request_tokens_per_s_mean": sum(r["tok_per_s"] for r in records) / len(records),
        **acceptance,
        "accept_length": tau,
        "accept_per_pos": acceptance.get("accept_per_pos", []),
    }
    for q in PERCENTILES:
        metrics[f"ttft_p{q}_ms"] = _ms(percentile(ttfts, q))
        metrics[f"itl_p{q}_ms"] = _ms(percentile(itls, q))
        metrics[f"latency_p{q}_ms"] = _ms(percentile([r["latency_s"] for r in records], q))
    return {k: v for k, v in metrics.items() if v is not None}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def acceptance_for(engine: str, delta: dict, records: list[dict], spec: Spec) -> dict:
    """vLLM and our server: counter deltas (per position too); SGLang: completion / verify steps."""
    if not spec.enabled:
        return {"accept_length": 1.0}
    found = acceptance_from_counters(delta)
    if found:
        return found
    steps = sum(r.get("verify_steps", 0) for r in records)
    if steps:
        return {"accept_length": sum(r["output_tokens"] for r in records) / steps}
    raise EngineFailed(
        f"{engine} reported no speculative acceptance for spec {spec.label} "
        "(no draft counters, no spec_verify_ct): is the drafter loaded?"
    )


def measure_pass(
    engine, bench: BenchConfig, engine_name: str, spec: Spec, requests, desc: str
) -> dict:
    """One pass of the suite on a warm engine: its metrics and request records."""
    before = engine.counters()
    records, wall_s = engine.run(requests, bench, desc)
    engine.check_alive()
    delta = counter_delta(before, engine.counters())
    metrics = aggregate(records, wall_s, acceptance_for(engine_name, delta, records, spec))
    return {**metrics, "records": records}


def measure(
    open_engine: Callable,
    bench: BenchConfig,
    engine_name: str,
    requests: list[list[int]],
    spec: Spec,
    drafter_path,
    folder: Path,
    against: Spread | None = None,
) -> dict:
    """Open the engine with `spec` (open_engine(spec, drafter_path, folder), eagle3.bench.engines),
    warm up, run the suite bench.repeats times, stop it; the median of the passes with the spread
    of their tok/s (eagle3.bench.verdict.combine_repeats). Against spec=off's spread, the passes
    stop after bench.min_repeats once the two ranges are apart by more than either's width
    (Spread.apart)."""
    folder.mkdir(parents=True, exist_ok=True)
    engine = open_engine(spec, drafter_path, folder)
    repeats = max(int(bench.repeats), 1)
    passes = []
    try:
        warmup = warmup_count(bench, len(requests))
        if warmup:
            engine.run(requests[:warmup], bench, "warmup")
        started = time.monotonic()
        for index in range(repeats):
            desc = f"{engine_name} {spec.label} {index + 1}/{repeats}"
            passes.append(measure_pass(engine, bench, engine_name, spec, requests, desc))
            if settled(passes, against, bench.min_repeats):
                log.info("%s: tok/s apart from spec=off after %d passes", spec.label, len(passes))
                break
            left_s = (time.monotonic() - started) / len(passes) * (repeats - len(passes))
            if left_s:
                log.info("%s done, about %.0f s of passes left", desc, left_s)
    finally:
        engine.stop()
    records = [p.pop("records") for p in passes]
    (folder / "requests.json").write_text(json.dumps(records, indent=1))
    metrics = combine_repeats(passes)
    if bench.check_outputs:  # the first pass's token ids, compared with spec=off's
        metrics["outputs"] = [r.get("output_ids", []) for r in records[0]]
    return metrics


def warmup_count(bench: BenchConfig, prompts: int) -> int:
    """Requests sent before measuring: bench.warmup, else one full batch of the suite's prompts."""
    if bench.warmup is not None:
        return bench.warmup
    return min(bench.batch_size, prompts)


def settled(passes: list[dict], against: Spread | None, min_repeats: int) -> bool:
    """Enough passes: at least min_repeats, and their tok/s range apart from spec=off's."""
    if against is None or len(passes) < max(int(min_repeats), 1):
        return False
    return Spread.of([p["tokens_per_s"] for p in passes]).apart(against)
