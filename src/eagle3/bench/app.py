"""`python -m eagle3.bench`: deploy target + drafter with the job's `spec`, warm up, run the prompt
suite, measure, log one MLflow run. `-m spec.depth=16,10` sweeps: one parent run per sweep (the
Hydra callback in eagle3.bench.sweep), one child run per job, a summary table, plots and cost model
at the end. Speedup is against the same engine with spec=off, measured once per (engine, target,
suite, batch size, max tokens) and cached like a stage artifact.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import platform
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from eagle3.bench import sweep
from eagle3.bench.verdict import (
    ACCEPTS_NOTHING,
    Spread,
    accepts_nothing,
    against_off,
    combine_repeats,
    speedup_fields,
)
from eagle3.core.artifacts import read_json, stage_output
from eagle3.core.common import Eagle3Error, app, hardware, local_engine_version, log
from eagle3.core.config import BenchConfig, Config, plain
from eagle3.core.drafter_io import check_folder_for_target
from eagle3.core.redact import mask_text
from eagle3.core.spec import OFF, Spec, resolve_spec
from eagle3.core.target import (
    folder_text_config,
    latent_attention,
    target_path_for,
    target_tokenizer,
)
from eagle3.core.tracking import stage_run
from eagle3.data.suites import check_bench_settings, load_suite, suite_name, suite_names
from eagle3.serve import inprocess
from eagle3.serve.counters import acceptance_from_counters, counter_delta, read_counters
from eagle3.serve.drafter import drafter_for
from eagle3.serve.launch import (
    EngineFailed,
    EngineProcess,
    check_spec_for_engine,
    engine_python,
    start_engine,
)

RESULT_FILE = "bench_result.json"
# the spec=off measurement's metrics a job carries as baseline_<key>
BASELINE_KEYS = ("tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "step_s")
PERCENTILES = (50, 90, 99)
LOG_EXCERPT_LINES = 40
# serve settings that do not change a measurement: not part of the baseline's identity
BASELINE_IGNORES = (
    "host",
    "port",
    "start_timeout_s",
    "stop_timeout_s",
    "request_timeout_s",
    "watchdog_poll_s",
    "grace_s",
    "disconnect_poll_s",
    "max_tokens_limit",
    "api_key_env",
    "max_depth",
    "error_lines",
)


# ---------------------------------------------------------------- requests


def tokenize_prompts(tokenizer, prompts) -> list[list[int]]:
    """Chat-templated token ids: every engine gets the same ids (no server-side templating)."""
    out = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            prompt.messages, add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def sse_events(response: httpx.Response) -> Iterator[dict]:
    for line in response.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield json.loads(data)


def generate_payload(ids, bcfg: BenchConfig, stream: bool) -> dict:
    """SGLang-native /generate (our local server speaks it too)."""
    return {
        "input_ids": ids,
        "stream": stream,
        "sampling_params": {
            "max_new_tokens": bcfg.max_new_tokens,
            "temperature": bcfg.temperature,
            "top_p": bcfg.top_p,
            "ignore_eos": bcfg.ignore_eos,
        },
    }


def openai_payload(ids, bcfg: BenchConfig, stream: bool, model: str) -> dict:
    payload = {
        "model": model,
        "prompt": ids,
        "max_tokens": bcfg.max_new_tokens,
        "temperature": bcfg.temperature,
        "top_p": bcfg.top_p,
        "ignore_eos": bcfg.ignore_eos,
        "stream": stream,
    }
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return payload


def send(client: httpx.Client, api: str, ids: list[int], bcfg: BenchConfig, model: str) -> dict:
    """One request; returns its timings, output token count and (generate API) verify steps."""
    stream = bool(bcfg.stream)
    url, payload = (
        ("/v1/completions", openai_payload(ids, bcfg, stream, model))
        if api == "openai"
        else ("/generate", generate_payload(ids, bcfg, stream))
    )
    start = time.perf_counter()
    first = None
    last: dict = {}
    if stream:
        with client.stream("POST", url, json=payload) as response:
            response.raise_for_status()
            for event in sse_events(response):
                if "error" in event:
                    raise httpx.HTTPError(f"server error: {json.dumps(event['error'])[:500]}")
                if first is None and _has_output(event):
                    first = time.perf_counter() - start
                last = _merge(last, event)
    else:
        response = client.post(url, json=payload)
        response.raise_for_status()
        last = response.json()
    latency = time.perf_counter() - start
    record = {"prompt_tokens": len(ids), "ttft_s": first, "latency_s": latency, **_counts(last)}
    record["tok_per_s"] = record["output_tokens"] / latency if latency > 0 else 0.0
    if bcfg.check_outputs:
        record["output_ids"] = list(last.get("output_ids") or [])
    return record


def _has_output(event: dict) -> bool:
    if "choices" in event:
        return any(c.get("text") for c in event["choices"])
    return bool(event.get("meta_info", {}).get("completion_tokens", 0) or event.get("text"))


def _merge(last: dict, event: dict) -> dict:
    """Keep the newest meta_info (cumulative) and the usage block (vLLM's final chunk)."""
    return {**last, **{k: v for k, v in event.items() if v is not None}}


def _counts(body: dict) -> dict:
    if "usage" in body:
        return {"output_tokens": int(body["usage"]["completion_tokens"])}
    meta = body.get("meta_info", {})
    out = {"output_tokens": int(meta.get("completion_tokens", 0))}
    if meta.get("spec_verify_ct"):
        out["verify_steps"] = int(meta["spec_verify_ct"])
    return out


def run_requests(
    engine: EngineProcess,
    requests: list[list[int]],
    bcfg: BenchConfig,
    timeout_s: float,
    model: str,
    desc: str,
) -> tuple[list[dict], float]:
    """All requests with bench.batch_size in flight (inprocess.in_flight); (records in prompt
    order, wall seconds). A failed request raises EngineFailed with the engine's log."""
    api = "openai" if engine.launch.engine == "vllm" else "generate"
    limits = httpx.Limits(max_connections=bcfg.batch_size)

    def one(ids: list[int]) -> dict:
        try:
            return send(client, api, ids, bcfg, model)
        except (httpx.HTTPError, json.JSONDecodeError, KeyError) as err:
            engine.check_alive(grace_s=5)  # raises EngineFailed with the log if it died
            raise EngineFailed(
                f"request to {engine.launch.engine} failed: {type(err).__name__}: {err}",
                engine.log_tail(),
            ) from err

    with httpx.Client(
        base_url=engine.base_url, timeout=timeout_s, limits=limits, headers=engine.launch.headers
    ) as client:
        return inprocess.in_flight(requests, bcfg.batch_size, one, desc)


# ---------------------------------------------------------------- measuring one engine


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


class Served:
    """An engine process measured through its HTTP API (the in-process engines of
    eagle3.serve.inprocess answer the same calls)."""

    def __init__(self, process: EngineProcess, cfg: Config, target_path):
        self.process, self.scfg, self.model = process, cfg.serve, str(target_path)

    def run(self, requests, bcfg: BenchConfig, desc: str) -> tuple[list[dict], float]:
        timeout_s = self.scfg.request_timeout_s
        return run_requests(self.process, requests, bcfg, timeout_s, self.model, desc)

    def counters(self) -> dict:
        try:
            return read_counters(
                self.scfg.engine, self.process.base_url, headers=self.process.launch.headers
            )
        except httpx.HTTPError as err:
            self.process.check_alive(grace_s=5)
            raise EngineFailed(
                f"{self.scfg.engine} stats request failed: {err}", self.process.log_tail()
            ) from err

    def check_alive(self) -> None:
        self.process.check_alive()

    def stop(self) -> None:
        self.process.stop(self.scfg.stop_timeout_s)


def open_engine(cfg: Config, spec: Spec, drafter_path, target_path, folder: Path):
    """The engine a job measures: a started server, or with serve.inprocess one in this process."""
    if cfg.serve.inprocess:
        return inprocess.engine_for(cfg, spec, drafter_path)
    return Served(start_engine(cfg, spec, drafter_path, target_path, folder), cfg, target_path)


def measure_pass(engine, cfg: Config, spec: Spec, requests, desc: str) -> dict:
    """One pass of the suite on a warm engine: its metrics and request records."""
    before = engine.counters()
    records, wall_s = engine.run(requests, cfg.bench, desc)
    engine.check_alive()
    delta = counter_delta(before, engine.counters())
    metrics = aggregate(records, wall_s, acceptance_for(cfg.serve.engine, delta, records, spec))
    return {**metrics, "records": records}


def measure(
    cfg: Config,
    spec: Spec,
    drafter_path,
    target_path,
    requests: list[list[int]],
    folder: Path,
    against: Spread | None = None,
) -> dict:
    """Start the engine with `spec`, warm up, run the suite bench.repeats times, stop it; the
    median of the passes with the spread of their tok/s (eagle3.bench.verdict.combine_repeats). Against
    spec=off's spread, the passes stop after bench.min_repeats once the two ranges are apart by more
    than either's width (Spread.apart)."""
    bcfg = cfg.bench
    folder.mkdir(parents=True, exist_ok=True)
    engine = open_engine(engine_cfg(cfg, spec), spec, drafter_path, target_path, folder)
    repeats = max(int(bcfg.repeats), 1)
    passes = []
    try:
        if bcfg.warmup:
            engine.run(requests[: bcfg.warmup], bcfg, "warmup")
        started = time.monotonic()
        for index in range(repeats):
            desc = f"{cfg.serve.engine} {spec.label} {index + 1}/{repeats}"
            passes.append(measure_pass(engine, cfg, spec, requests, desc))
            if settled(passes, against, bcfg.min_repeats):
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
    if bcfg.check_outputs:  # the first pass's token ids, compared with spec=off's
        metrics["outputs"] = [r.get("output_ids", []) for r in records[0]]
    return metrics


def engine_cfg(cfg: Config, spec: Spec) -> Config:
    """The config a job's engine is built from: the job's spec at every step (engine.schedule=auto
    counts as off here, so a shape sweep measures each shape; spec=off never runs a schedule); a
    schedule file given by path applies to the job's engine."""
    setting = str(cfg.engine.schedule)
    if setting == "off" or (spec.enabled and setting != "auto"):
        return cfg
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, schedule="off"))


def settled(passes: list[dict], against: Spread | None, min_repeats: int) -> bool:
    """Enough passes: at least min_repeats, and their tok/s range apart from spec=off's."""
    if against is None or len(passes) < max(int(min_repeats), 1):
        return False
    return Spread.of([p["tokens_per_s"] for p in passes]).apart(against)


# ---------------------------------------------------------------- the baseline, cached


def baseline_output(cfg: Config, scope: str | None = None):
    """Where the spec=off measurement for this (engine, target, suite, batch size, max tokens)
    lives; `scope` (a sweep folder) keeps each sweep's own measurement apart."""
    serve = {k: v for k, v in plain(cfg.serve).items() if k not in BASELINE_IGNORES}
    bench = {
        k: v
        for k, v in plain(cfg.bench).items()
        if k not in ("suites", "reuse_baseline", "cost_model_depths", "min_repeats")
    }
    suite = (
        [plain(cfg.bench.suites.get(name)) for name in suite_names(cfg.bench)]
        if not cfg.bench.prompts
        else None
    )
    sections = {
        "serve": serve,
        "target": plain(cfg.target),
        "bench": bench,
        "suite": suite,
        "machine": platform.node(),
    }
    if scope:
        sections["scope"] = str(scope)
    return stage_output(cfg.paths.artifacts, "bench_baseline", sections)


def earlier_baseline(cfg: Config):
    """The newest complete spec=off measurement of this configuration from any sweep, or None."""
    wanted = json.loads(json.dumps(baseline_output(cfg).config, default=str))
    found = []
    for manifest_path in Path(cfg.paths.artifacts, "bench_baseline").glob("*/manifest.json"):
        manifest = read_json(
            manifest_path, f"remove {manifest_path.parent}: the next job measures again"
        )
        config = {k: v for k, v in manifest.get("config", {}).items() if k != "scope"}
        if manifest.get("complete") and config == wanted:
            found.append((manifest.get("measured_at", 0.0), manifest_path.parent, manifest))
    return max(found, key=lambda item: item[0], default=None)


def baseline(cfg: Config, target_path, requests, folder: Path, scope: str) -> dict:
    """spec=off for this job: measured once per sweep (`scope`), or with bench.reuse_baseline the
    newest earlier measurement, whose run id and age the result then carries."""
    if cfg.bench.reuse_baseline:
        earlier = earlier_baseline(cfg)
        if earlier:
            measured_at, path, manifest = earlier
            log.info("reusing the spec=off baseline %s (run %s)", path, manifest.get("run_id"))
            return {
                **json.loads((path / "metrics.json").read_text()),
                "baseline_reused": True,
                "baseline_run_id": manifest.get("run_id"),
                "baseline_age_s": time.time() - measured_at,
            }
    out = baseline_output(cfg, scope)
    with out.lock():  # jobs of one sweep running at once (a parallel launcher): one measures
        if out.complete:
            manifest = out.manifest()
            return {
                **json.loads((out.path / "metrics.json").read_text()),
                "baseline_reused": False,
                "baseline_run_id": manifest.get("run_id"),
            }
        metrics = measure(cfg, OFF, None, target_path, requests, folder / "baseline")
        out.start()
        (out.path / "metrics.json").write_text(json.dumps(metrics, indent=1))
        run_id = active_run_id()
        counts = {"requests": metrics["requests"], "output_tokens": metrics["output_tokens"]}
        out.finish(counts, run_id=run_id, measured_at=time.time())
    return {**metrics, "baseline_reused": False, "baseline_run_id": run_id}


def active_run_id() -> str | None:
    """The MLflow run this job logs to (None with tracking off)."""
    import sys

    mlflow = sys.modules.get("mlflow")
    run = mlflow.active_run() if mlflow else None
    return run.info.run_id if run else None


# ---------------------------------------------------------------- one job


def job_identity(cfg: Config) -> dict:
    """What a job varied: shown in the summary even when the job failed before measuring."""
    ident = {
        "engine": cfg.serve.engine,
        "target": cfg.target.name,
        "suite": suite_name(cfg.bench),
        "batch_size": cfg.bench.batch_size,
        "max_new_tokens": cfg.bench.max_new_tokens,
        "spec": "invalid",
        "depth": cfg.spec.depth,
        "steps": cfg.spec.steps,
        "topk": cfg.spec.topk,
        "spec_enabled": bool(cfg.spec.enabled),
    }
    try:
        spec = resolve_spec(cfg.spec)
        ident.update(spec=spec.label, depth=spec.depth, steps=spec.steps, topk=spec.topk)
    except Eagle3Error:
        pass
    return ident


def check_engine_supports(cfg: Config, target_path: Path | str) -> None:
    """The embedded engine (serve=local) caches keys and values per head at one width (Llama-style
    attention, engine/kv.py); a target with latent attention is served by SGLang or vLLM."""
    config = folder_text_config(target_path)
    if cfg.serve.engine == "local" and config is not None and latent_attention(config):
        raise Eagle3Error(
            f"serve=local cannot run target {cfg.target.name} ({config.get('model_type')}: "
            "multi-head latent attention, which the embedded engine does not implement); "
            "use serve=sglang or serve=vllm"
        )


def bench_requests(cfg: Config) -> tuple[Path | str, list[list[int]]]:
    """Check the bench settings and prompts before anything heavy: settings, then the prompts
    (before the target is converted), then that each prompt and its completion fit the engine's
    context (before an engine is built) -> (the target's folder, the prompts' token ids)."""
    check_bench_settings(cfg.bench)
    check_tokens_fit(cfg, *settings_context(cfg))
    prompts = load_suite(cfg.bench)
    target_path = target_path_for(cfg)
    requests = tokenize_prompts(target_tokenizer(target_path, cfg.target), prompts)
    check_context(cfg, prompts, requests, target_path)
    return target_path, requests


def engine_context(cfg: Config, target_path) -> tuple[int | None, str]:
    """(tokens one request may hold, prompt + completion; the setting that sets it)."""
    config = Path(str(target_path)) / "config.json"
    positions = (
        json.loads(config.read_text()).get("max_position_embeddings") if config.exists() else None
    )
    if cfg.serve.engine == "vllm":
        return int(cfg.serve.max_model_len), "serve.max_model_len"
    if cfg.serve.engine in inprocess.ENGINES:
        limit = int(cfg.engine.max_context)
        return (min(limit, positions) if positions else limit), "engine.max_context"
    return positions, "the target's max_position_embeddings"


def settings_context(cfg: Config) -> tuple[int | None, str]:
    """engine_context as far as the settings say, before the target's folder exists (a converted
    or built target's config.json holds the rest): serve.max_model_len, engine.max_context, a
    random target's max_position_embeddings, a local target folder's config.json."""
    if cfg.serve.engine == "vllm":
        return int(cfg.serve.max_model_len), "serve.max_model_len"
    positions = getattr(cfg.target, "max_position_embeddings", None)
    folder = Path(str(cfg.target.path)).expanduser() if cfg.target.path else None
    if positions is None and folder is not None and (folder / "config.json").is_file():
        positions = (folder_text_config(folder) or {}).get("max_position_embeddings")
    if cfg.serve.engine in inprocess.ENGINES:
        limit = int(cfg.engine.max_context)
        return (min(limit, int(positions)) if positions else limit), "engine.max_context"
    return (int(positions), "the target's max_position_embeddings") if positions else (None, "")


def check_tokens_fit(cfg: Config, context: int | None, setting: str) -> None:
    """bench.max_new_tokens leaves room for a prompt in the engine's context."""
    wanted = int(cfg.bench.max_new_tokens)
    if context is not None and wanted >= context:
        raise Eagle3Error(
            f"bench.max_new_tokens={wanted} does not fit the {cfg.serve.engine} engine's context "
            f"of {context:,} tokens ({setting}), prompt and completion together: ask for fewer tokens"
        )


def check_context(cfg: Config, prompts, requests: list[list[int]], target_path) -> None:
    """Every prompt with bench.max_new_tokens after it fits the engine's context (an engine
    would refuse it, or cut its answer short, after it was built and other prompts ran)."""
    context, setting = engine_context(cfg, target_path)
    wanted = int(cfg.bench.max_new_tokens)
    if context is None or not requests:
        return
    engine = f"the {cfg.serve.engine} engine's context of {context:,} tokens ({setting})"
    check_tokens_fit(cfg, context, setting)
    longest = max(range(len(requests)), key=lambda i: len(requests[i]))
    if len(requests[longest]) + wanted > context:
        raise Eagle3Error(
            f"prompt {prompts[longest].id} of {suite_name(cfg.bench)} has "
            f"{len(requests[longest]):,} tokens: with bench.max_new_tokens={wanted} it does not fit "
            f"{engine}; lower bench.max_new_tokens, raise {setting}, or set bench.limit to leave it out"
        )


def check_drafter_fits(cfg: Config, drafter_path: Path | None, target_path) -> None:
    """The drafter drafts for this target (hidden size, vocab, positions, aux layers, tokenizer,
    from the two folders' config.json), refused before spec=off is measured or an engine starts."""
    target_config = folder_text_config(target_path)
    if drafter_path is None or target_config is None:  # no drafter, or a hub id: the engine checks
        return
    check_folder_for_target(
        Path(drafter_path),
        target_config,
        target_path,
        cfg.target.aux_layer_ids,
        lambda: target_tokenizer(target_path, cfg.target),
        "vllm" if cfg.serve.engine == "vllm" else "sglang",
    )


def job_spec(cfg: Config) -> Spec:
    """The job's spec, refused when impossible or when its engine cannot run it."""
    if cfg.spec.schedule:
        raise Eagle3Error(
            "spec=auto serves a load sweep's schedule (python -m eagle3.serve spec=auto); a bench "
            "job measures one shape: give spec=... or sweep them (-m spec=off,d4,d8)"
        )
    spec = resolve_spec(cfg.spec)
    check_spec_for_engine(cfg.serve.engine, spec, cfg.serve.max_depth)
    if cfg.serve.inprocess and cfg.serve.engine not in inprocess.ENGINES:
        raise Eagle3Error(
            f"serve.inprocess=true runs serve=local or serve=hf inside the bench; "
            f"{cfg.serve.engine} runs as its own server (serve.inprocess=false)"
        )
    return spec


def measure_job(cfg: Config, folder: Path, scope: str | None = None) -> dict:
    """Validate, find drafter and prompts, measure (baseline first), compute speedup. The
    baseline is shared by the jobs of one `scope` (a sweep folder; a lone job's own folder)."""
    check_output_settings(cfg)
    spec = job_spec(cfg)
    target_path, requests = bench_requests(cfg)
    check_engine_supports(cfg, target_path)
    drafter_path = drafter_for(cfg, spec)
    check_drafter_fits(cfg, drafter_path, target_path)
    base = baseline(cfg, target_path, requests, folder, str(scope or folder))
    metrics = (
        measure(cfg, spec, drafter_path, target_path, requests, folder / "spec", off_spread(base))
        if spec.enabled
        else {k: v for k, v in base.items() if not k.startswith("baseline_")}
    )
    metrics.update({f"baseline_{k}": base.get(k) for k in BASELINE_KEYS})
    metrics.update({k: v for k, v in base.items() if k.startswith("baseline_")})
    metrics.update(speedup_fields(metrics, base))
    metrics.update(
        drafter=str(drafter_path) if drafter_path else None, drafter_hash=drafter_hash(drafter_path)
    )
    outputs = metrics.pop("outputs", None)
    if cfg.bench.check_outputs:
        check = compare_outputs(requests, base.get("outputs") or [], outputs or [], cfg)
        (folder / "output_check.json").write_text(json.dumps(check, indent=1))
        metrics.update(check)
        log.info("%s", output_check_line(spec.label, check))
    return metrics


def off_spread(base: dict) -> Spread | None:
    """spec=off's tok/s spread, when measured over more than one pass (one pass has no range)."""
    if base.get("repeats", 1) < 2 or "tokens_per_s_min" not in base:
        return None
    return Spread.from_result(base, "tokens_per_s")


# ---------------------------------------------------------------- outputs against spec=off


def check_output_settings(cfg: Config) -> None:
    """bench.check_outputs compares greedy outputs, which only /generate answers carry."""
    if not cfg.bench.check_outputs:
        return
    if cfg.bench.temperature != 0:
        raise Eagle3Error(
            f"bench.check_outputs=true compares greedy outputs; bench.temperature="
            f"{cfg.bench.temperature} samples (set it to 0)"
        )
    if cfg.serve.engine not in ("local", "sglang"):
        raise Eagle3Error(
            f"bench.check_outputs=true needs output token ids, which serve={cfg.serve.engine} "
            "does not return; use serve=local or serve=sglang"
        )


def first_divergence(expected: list[int], got: list[int]) -> int | None:
    """The first position where two outputs differ (a longer one differs where the shorter ends)."""
    for index, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return index
    return None if len(expected) == len(got) else min(len(expected), len(got))


def compare_outputs(
    prompts: list[list[int]], off: list[list[int]], outputs: list[list[int]], cfg: Config
) -> dict:
    """How many outputs equal spec=off's and, per one that differs, where it first does and the
    target's logit margin there (spec=off's token minus this output's; None past either's end)."""
    if len(off) != len(outputs):
        raise Eagle3Error(
            f"bench.check_outputs: spec=off kept {len(off)} outputs and this shape {len(outputs)}; "
            "measure the baseline with check_outputs on (bench.reuse_baseline=false)"
        )
    diverged = []
    logits_at = None
    for index, (prompt, expected, got) in enumerate(zip(prompts, off, outputs)):
        position = first_divergence(expected, got)
        if position is None:
            continue
        entry = {"prompt": index, "position": position, "margin": None}
        if position < min(len(expected), len(got)):
            logits_at = logits_at or target_logits(cfg)
            row = logits_at(prompt + expected[:position])
            entry.update(
                off_token=expected[position],
                token=got[position],
                margin=float(row[expected[position]] - row[got[position]]),
            )
        diverged.append(entry)
    return {
        "outputs_compared": len(off),
        "outputs_equal_off": len(off) - len(diverged),
        "output_divergences": diverged,
    }


def target_logits(cfg: Config):
    """ids -> the target's next-token logits (float32) after them: the target loaded here once."""
    import torch

    from eagle3.core.target import load_target

    target = load_target(cfg)

    @torch.inference_mode()
    def logits(ids: list[int]) -> torch.Tensor:
        tensor = torch.tensor([ids], device=target.device)
        return target.model(tensor).logits[0, -1].float().cpu()

    return logits


def output_check_line(label: str, check: dict) -> str:
    line = (
        f"{label}: {check['outputs_equal_off']} of {check['outputs_compared']} outputs equal "
        "spec=off's"
    )
    for entry in check["output_divergences"]:
        margin = "" if entry["margin"] is None else f", logit margin {entry['margin']:.4g}"
        line += f"; prompt {entry['prompt']} from token {entry['position']}{margin}"
    return line


def run_job(
    cfg: Config, folder: Path, parent_run_id: str | None = None, sweep_dir: Path | None = None
) -> dict:
    """One job, never raising for an engine or spec failure: the result says ok or failed."""
    folder.mkdir(parents=True, exist_ok=True)
    result = {**job_identity(cfg), "folder": str(folder)}
    name = f"{result['engine']}-{result['spec']}-bs{result['batch_size']}"
    with stage_run(
        cfg,
        "bench",
        run_name=name,
        parent_run_id=parent_run_id,
        tags={"engine": result["engine"], "spec": result["spec"]},
    ) as run:
        try:
            result.update(measure_job(cfg, folder, sweep_dir), status="ok")
            result.update(provenance(cfg))
        except (Eagle3Error, OSError, httpx.HTTPError) as err:
            result.update(
                status="failed",
                error=mask_text(f"{type(err).__name__}: {err}"),
                log_tail=getattr(err, "log_tail", ""),
            )
            log.error("bench job %s failed: %s", name, err)
        if run is not None:
            result["run_id"] = run.info.run_id
            log_job(cfg, result)
    (folder / RESULT_FILE).write_text(json.dumps(result, indent=1, default=str))
    return result


# settings of a job, logged as params (MLflow compares runs on them); measurements are metrics
JOB_PARAMS = ("engine", "spec", "depth", "steps", "topk", "batch_size", "max_new_tokens", "suite")
NOT_METRICS = frozenset((*JOB_PARAMS, "repeats", "spec_enabled", "baseline_reused", "temperature"))


def job_params(cfg: Config, result: dict) -> dict:
    """What a job ran: its shape, load and suite, the target, drafter, hardware, engine version."""
    params = {k: result.get(k) for k in JOB_PARAMS}
    params.update(
        target=cfg.target.name,
        drafter=result.get("drafter_hash"),
        **{k: result.get(k) for k in PROVENANCE},
        repeats=cfg.bench.repeats,
    )
    return {k: "" if v is None else str(v) for k, v in params.items()}


def job_metrics(result: dict) -> dict:
    """The numbers a job measured (per-position acceptance as accept_pos_i)."""
    numbers = {
        k: float(v)
        for k, v in result.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in NOT_METRICS
    }
    numbers.update({f"accept_pos_{i}": p for i, p in enumerate(result.get("accept_per_pos", []))})
    return numbers


# what every result row carries about where and how it was measured (besides drafter_hash)
PROVENANCE = ("hardware", "engine_version", "torch_version", "dtype", "temperature", "git_commit")


def provenance(cfg: Config) -> dict:
    """The machine, engine and its version, torch, dtype, sampling temperature and git commit of a
    measured job. dtype: the target's as configured for the local engine (auto = bfloat16 on a GPU,
    float32 on a CPU), serve.dtype for vLLM and SGLang."""
    import torch

    from eagle3.core.artifacts import git_commit

    dtype = cfg.target.dtype if cfg.serve.engine in ("local", "hf") else cfg.serve.dtype
    if dtype == "auto":
        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    return {
        "hardware": hardware(),
        "engine_version": engine_version(cfg),
        "torch_version": torch.__version__,
        "dtype": str(dtype),
        "temperature": float(cfg.bench.temperature),
        "git_commit": git_commit(),
    }


def drafter_hash(path) -> str | None:
    """The export hash of a drafter folder (its manifest, or the parent export's), else its name."""
    if not path:
        return None
    for folder in (Path(path), Path(path).parent):
        manifest = folder / "manifest.json"
        if manifest.exists():
            return read_json(manifest, "export the drafter again").get("hash") or folder.name
    return Path(path).name


def engine_version(cfg: Config) -> str:
    """The serving engine's package version (read from its own interpreter for vLLM / SGLang)."""
    import subprocess

    if cfg.serve.engine == "local":
        return local_engine_version()
    if cfg.serve.engine == "hf":
        import transformers

        return f"transformers {transformers.__version__}"
    code = (
        "import importlib.metadata as m\n"
        f"for name in ('{cfg.serve.engine}', '{cfg.serve.engine}-cpu'):\n"
        "    try: print(m.version(name)); break\n"
        "    except m.PackageNotFoundError: pass"
    )
    try:
        done = subprocess.run(
            [engine_python(cfg.serve), "-c", code], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return f"{cfg.serve.engine} {done.stdout.strip() or 'unknown'}"


def job_value(result: dict) -> float:
    """A job's score for a search (search=shapes): its median tok/s, 0 when it failed."""
    return float(result["tokens_per_s"]) if result.get("status") == "ok" else 0.0


def log_job(cfg: Config, result: dict) -> None:
    """Settings as params, measurements as metrics (tok/s per pass as steps of tokens_per_s_pass),
    or the failure, on the active child run."""
    import mlflow

    mlflow.set_tag("status", result["status"])
    mlflow.log_params({f"job.{k}": v for k, v in job_params(cfg, result).items()})
    if result["status"] != "ok":
        mlflow.set_tag("error", result["error"][:5000])
        mlflow.log_text(
            f"{result['error']}\n\n--- engine log (last {LOG_EXCERPT_LINES} lines) ---\n"
            f"{result.get('log_tail', '')}\n",
            "failure.txt",
        )
        mlflow.end_run(status="FAILED")
        return
    mlflow.set_tag("vs_spec_off", against_off(result, baseline_of(result)))
    if accepts_nothing(result, float(cfg.bench.accepts_nothing_tau)):
        mlflow.set_tag("acceptance", ACCEPTS_NOTHING)
    if result.get("baseline_run_id"):
        mlflow.set_tag("baseline_run_id", result["baseline_run_id"])
    mlflow.log_metrics(job_metrics(result))
    for step, value in enumerate(result.get("tokens_per_s_runs", [])):
        mlflow.log_metric("tokens_per_s_pass", value, step=step)
    mlflow.log_dict(result, "bench_result.json")


def baseline_of(result: dict) -> dict:
    """A job's spec=off measurement as the verdict reads it."""
    return {
        k.removeprefix("baseline_"): result.get(k) for k in map("baseline_{}".format, BASELINE_KEYS)
    }


# ---------------------------------------------------------------- the app


@app
def main(cfg: Config) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request in the job log
    hydra_cfg = HydraConfig.get()
    folder = Path(hydra_cfg.runtime.output_dir)
    # settings, prompts and context, checked before any run or engine: one error line, and in a
    # sweep the first job stops it (every job would fail the same way); a lone job's spec first,
    # before the target is prepared (in a sweep a spec one engine cannot run fails that job only)
    if hydra_cfg.mode != RunMode.MULTIRUN:
        job_spec(cfg)
    bench_requests(cfg)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        sweep_dir = Path(hydra_cfg.sweep.dir)
        log.info(sweep.progress_line(sweep_dir))
        result = run_job(cfg, folder, sweep.parent_run_id(sweep_dir), sweep_dir)
        return job_value(result)  # the score a search ranks jobs by (search=shapes)
    result = run_job(cfg, folder)
    sweep.summarize(cfg, [result], folder)
    if result["status"] != "ok":
        raise Eagle3Error(f"bench job failed: {result['error']}")


if __name__ == "__main__":
    main()
