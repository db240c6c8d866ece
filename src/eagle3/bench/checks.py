"""A job's settings, prompts, spec and drafter, checked before anything heavy: one error line
before the target is prepared, an engine is built or spec=off is measured."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.bench.client import tokenize_prompts
from eagle3.core.common import Eagle3Error
from eagle3.core.config import BenchConfig, EngineConfig, ServeConfig, SpecConfig, TargetConfig
from eagle3.core.drafter_io import check_folder_for_target
from eagle3.core.spec import Spec, resolve_spec
from eagle3.core.target import (
    folder_text_config,
    latent_attention,
    resolve_target_path,
    target_tokenizer,
)
from eagle3.data.suites import check_bench_settings, load_suite, suite_name
from eagle3.serve import inprocess
from eagle3.serve.launch import check_spec_for_engine


def check_engine_supports(engine_name: str, target: TargetConfig, target_path: Path | str) -> None:
    """The embedded engine (serve=local) caches keys and values per head at one width (Llama-style
    attention, engine/kv.py); a target with latent attention is served by SGLang or vLLM."""
    config = folder_text_config(target_path)
    if engine_name == "local" and config is not None and latent_attention(config):
        raise Eagle3Error(
            f"serve=local cannot run target {target.name} ({config.get('model_type')}: "
            "multi-head latent attention, which the embedded engine does not implement); "
            "use serve=sglang or serve=vllm"
        )


def bench_requests(
    bench: BenchConfig, serve: ServeConfig, engine: EngineConfig, target: TargetConfig, artifacts
) -> tuple[Path | str, list[list[int]]]:
    """Check the bench settings and prompts before anything heavy: settings, then the prompts
    (before the target is converted), then that each prompt and its completion fit the engine's
    context (before an engine is built) -> (the target's folder, the prompts' token ids)."""
    check_bench_settings(bench)
    check_tokens_fit(bench, serve.engine, *settings_context(serve, engine, target))
    prompts = load_suite(bench)
    target_path = resolve_target_path(target, Path(artifacts))
    requests = tokenize_prompts(target_tokenizer(target_path, target), prompts)
    context = engine_context(serve, engine, target_path)
    check_context(bench, serve.engine, context, prompts, requests)
    return target_path, requests


def engine_context(serve: ServeConfig, engine: EngineConfig, target_path) -> tuple[int | None, str]:
    """(tokens one request may hold, prompt + completion; the setting that sets it)."""
    config = Path(str(target_path)) / "config.json"
    positions = (
        json.loads(config.read_text()).get("max_position_embeddings") if config.exists() else None
    )
    if serve.engine == "vllm":
        return int(serve.max_model_len), "serve.max_model_len"
    if serve.engine in inprocess.ENGINES:
        limit = int(engine.max_context)
        return (min(limit, positions) if positions else limit), "engine.max_context"
    return positions, "the target's max_position_embeddings"


def settings_context(
    serve: ServeConfig, engine: EngineConfig, target: TargetConfig
) -> tuple[int | None, str]:
    """engine_context as far as the settings say, before the target's folder exists (a converted
    or built target's config.json holds the rest): serve.max_model_len, engine.max_context, a
    random target's max_position_embeddings, a local target folder's config.json."""
    if serve.engine == "vllm":
        return int(serve.max_model_len), "serve.max_model_len"
    positions = getattr(target, "max_position_embeddings", None)
    folder = Path(str(target.path)).expanduser() if target.path else None
    if positions is None and folder is not None and (folder / "config.json").is_file():
        positions = (folder_text_config(folder) or {}).get("max_position_embeddings")
    if serve.engine in inprocess.ENGINES:
        limit = int(engine.max_context)
        return (min(limit, int(positions)) if positions else limit), "engine.max_context"
    return (int(positions), "the target's max_position_embeddings") if positions else (None, "")


def check_tokens_fit(
    bench: BenchConfig, engine_name: str, context: int | None, setting: str
) -> None:
    """bench.max_new_tokens leaves room for a prompt in the engine's context."""
    wanted = int(bench.max_new_tokens)
    if context is not None and wanted >= context:
        raise Eagle3Error(
            f"bench.max_new_tokens={wanted} does not fit the {engine_name} engine's context "
            f"of {context:,} tokens ({setting}), prompt and completion together: ask for fewer tokens"
        )


def check_context(
    bench: BenchConfig,
    engine_name: str,
    context: tuple[int | None, str],
    prompts,
    requests: list[list[int]],
) -> None:
    """Every prompt with bench.max_new_tokens after it fits the engine's context (engine_context;
    an engine would refuse it, or cut its answer short, after it was built and other prompts ran)."""
    tokens, setting = context
    wanted = int(bench.max_new_tokens)
    if tokens is None or not requests:
        return
    engine = f"the {engine_name} engine's context of {tokens:,} tokens ({setting})"
    check_tokens_fit(bench, engine_name, tokens, setting)
    longest = max(range(len(requests)), key=lambda i: len(requests[i]))
    if len(requests[longest]) + wanted > tokens:
        raise Eagle3Error(
            f"prompt {prompts[longest].id} of {suite_name(bench)} has "
            f"{len(requests[longest]):,} tokens: with bench.max_new_tokens={wanted} it does not fit "
            f"{engine}; lower bench.max_new_tokens, raise {setting}, or set bench.limit to leave it out"
        )


def check_drafter_fits(
    target: TargetConfig, engine_name: str, drafter_path: Path | None, target_path
) -> None:
    """The drafter drafts for this target (hidden size, vocab, positions, aux layers, tokenizer,
    from the two folders' config.json), refused before spec=off is measured or an engine starts."""
    target_config = folder_text_config(target_path)
    if drafter_path is None or target_config is None:  # no drafter, or a hub id: the engine checks
        return
    check_folder_for_target(
        Path(drafter_path),
        target_config,
        target_path,
        target.aux_layer_ids,
        lambda: target_tokenizer(target_path, target),
        "vllm" if engine_name == "vllm" else "sglang",
    )


def job_spec(spec: SpecConfig, serve: ServeConfig) -> Spec:
    """The job's spec, refused when impossible or when its engine cannot run it."""
    if spec.schedule:
        raise Eagle3Error(
            "spec=auto serves a load sweep's schedule (python -m eagle3.serve spec=auto); a bench "
            "job measures one shape: give spec=... or sweep them (-m spec=off,d4,d8)"
        )
    resolved = resolve_spec(spec)
    check_spec_for_engine(serve.engine, resolved, serve.max_depth)
    if serve.inprocess and serve.engine not in inprocess.ENGINES:
        raise Eagle3Error(
            f"serve.inprocess=true runs serve=local or serve=hf inside the bench; "
            f"{serve.engine} runs as its own server (serve.inprocess=false)"
        )
    return resolved
