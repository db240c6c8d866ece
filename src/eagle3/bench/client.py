"""The bench's HTTP client: the prompts as token ids, one request to an engine's API (SGLang-native
/generate or OpenAI /v1/completions, streamed as server-sent events or not) and a suite of them with
bench.batch_size in flight."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx

from eagle3.core.config import BenchConfig
from eagle3.serve import inprocess
from eagle3.serve.launch import EngineFailed, EngineProcess


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
