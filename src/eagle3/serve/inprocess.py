"""Engines the bench measures inside its own process (`serve.inprocess=true`), with no server and
no HTTP in between, so GPU timings hold the engine's own cost alone:

- serve=local: the embedded engine's EngineService, built from the same config the local server
  gets (EngineSetup.local_config): the fused batch-1 decoder, or continuous batching above batch 1.
- serve=hf: HF transformers' `generate` on the target, in static batches of bench.batch_size
  left-padded prompts, without speculation: the reference a user would otherwise pick.

Both answer like a served engine: run() gives one record per request (tokens, latency, time to
first token, verify steps) and counters() the cumulative acceptance counters, so the bench's passes,
repeats, baseline and summary take one code path. The engine of the last job stays built while
the next job of the same process (a Hydra multirun's next job) asks for the same config.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3.core.common import log
from eagle3.core.config import BenchConfig, from_plain, plain
from eagle3.core.spec import Spec
from eagle3.core.target import Target
from eagle3.engine.service import Generation, service_for
from eagle3.serve.launch import EngineSetup

ENGINES = ("local", "hf")  # serve.engine values this module runs
_KEPT: dict = {}  # {"key": config key, "engine": the engine built for it}


class InProcess:
    """What the bench calls besides run() and counters(): nothing to watch or stop (the engine is
    kept for the next job; release() frees it)."""

    def check_alive(self) -> None:
        pass

    def stop(self) -> None:
        pass


class LocalEngine(InProcess):
    """The embedded engine's service, called directly."""

    def __init__(self, job: dict):
        self.service = service_for(from_plain(job))

    def counters(self) -> dict:
        return self.service.stats()

    def request(self, ids: list[int], bcfg: BenchConfig) -> dict:
        started = time.perf_counter()
        first: list[float] = []

        def on_text(_delta: str) -> None:
            if not first:
                first.append(time.perf_counter() - started)

        request = Generation(
            ids, bcfg.max_new_tokens, bcfg.temperature, bcfg.top_p, ignore_eos=bcfg.ignore_eos
        )
        reply = self.service.generate(request, on_text if bcfg.stream else None)
        latency = time.perf_counter() - started
        tokens = len(reply.tokens)
        return {
            "prompt_tokens": len(ids),
            "ttft_s": first[0] if first else None,
            "latency_s": latency,
            "output_tokens": tokens,
            "verify_steps": reply.result.stats.verify_steps,
            "tok_per_s": tokens / latency if latency > 0 else 0.0,
            **({"output_ids": list(reply.tokens)} if bcfg.check_outputs else {}),
        }

    def run(
        self, requests: list[list[int]], bcfg: BenchConfig, desc: str
    ) -> tuple[list[dict], float]:
        return in_flight(requests, bcfg.batch_size, lambda ids: self.request(ids, bcfg), desc)


class HFGenerate(InProcess):
    """HF `generate` on the target: static batches of bench.batch_size left-padded prompts, each
    batch's wall time every one of its requests' latency."""

    def __init__(self, target: Target):
        self.target = target
        tokenizer = self.target.tokenizer
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos

    def counters(self) -> dict:
        return {}

    def generate(self, batch: list[list[int]], bcfg: BenchConfig) -> list[int]:
        """Completion token counts of one batch (up to and including the first EOS)."""
        model = self.target.model
        width = max(map(len, batch))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        options = {"do_sample": False}
        if bcfg.temperature > 0:
            options = {"do_sample": True, "temperature": bcfg.temperature, "top_p": bcfg.top_p}
        if bcfg.ignore_eos:
            options["min_new_tokens"] = bcfg.max_new_tokens
        out = model.generate(
            ids,
            attention_mask=mask.to(model.device),
            max_new_tokens=bcfg.max_new_tokens,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
            **options,
        )
        return [completion_length(row, self.eos) for row in out[:, width:].tolist()]

    def run(
        self, requests: list[list[int]], bcfg: BenchConfig, desc: str
    ) -> tuple[list[dict], float]:
        records = []
        with tqdm(total=len(requests), desc=desc, leave=False) as bar:
            started = time.perf_counter()
            for start in range(0, len(requests), bcfg.batch_size):
                batch = requests[start : start + bcfg.batch_size]
                began = time.perf_counter()
                counts = self.generate(batch, bcfg)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                latency = time.perf_counter() - began
                records += [
                    {
                        "prompt_tokens": len(ids),
                        "ttft_s": None,
                        "latency_s": latency,
                        "output_tokens": count,
                        "tok_per_s": count / latency if latency > 0 else 0.0,
                    }
                    for ids, count in zip(batch, counts)
                ]
                bar.update(len(batch))
            return records, time.perf_counter() - started


def in_flight(requests: list, batch_size: int, one, desc: str) -> tuple[list[dict], float]:
    """one(request) for every request with batch_size in flight; (records in request order, wall
    seconds). Batch 1 runs in this thread. Interrupted (Ctrl-C, SIGTERM), it returns at once and
    cancels the requests not yet started; the caller stops the engine, which ends those in flight."""
    with tqdm(total=len(requests), desc=desc, leave=False) as bar:
        started, records = time.perf_counter(), []
        if batch_size == 1:
            for request in requests:
                records.append(one(request))
                bar.update()
            return records, time.perf_counter() - started
        pool = ThreadPoolExecutor(batch_size)
        try:
            for future in [pool.submit(one, request) for request in requests]:
                records.append(future.result())
                bar.update()
            return records, time.perf_counter() - started
        finally:
            pool.shutdown(wait=False, cancel_futures=True)


def completion_length(row: list[int], eos: int | None) -> int:
    """Tokens a request produced: through the first EOS (the engines count it too), else all."""
    return row.index(eos) + 1 if eos is not None and eos in row else len(row)


def engine_for(setup: EngineSetup, spec: Spec, drafter_path: Path | None, load_target: Callable):
    """The in-process engine for this job: the one kept from the previous job when its config is
    the same, else a fresh one (the kept one is freed first: one engine in memory at a time).
    serve=hf runs the target `load_target()` gives."""
    hf = setup.serve.engine == "hf"
    if hf:
        config = {"target": plain(setup.target), "hf": True}
    else:
        config = setup.local_config(spec, drafter_path)
    key = json.dumps(config, sort_keys=True, default=str)
    if _KEPT.get("key") == key:
        log.info("reusing the in-process %s engine of the previous job", setup.serve.engine)
        return _KEPT["engine"]
    release()
    engine = HFGenerate(load_target()) if hf else LocalEngine(config)
    _KEPT.update(key=key, engine=engine)
    return engine


def release() -> None:
    """Free the kept engine (its weights, caches and captured graphs) and forget what torch.compile
    compiled for it, so the next engine compiles as in a fresh process: on an H200 a d32s4k8 engine
    built after a d8 one in the same process decoded at 2.15-2.17x spec=off instead of 2.57x
    (results/smollm2-135m_h200_2026-12-03-bench.md)."""
    _KEPT.clear()
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
