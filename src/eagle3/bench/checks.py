"""A job's settings, prompts, spec and drafter, checked before anything heavy: one error line
before the target is prepared, an engine is built or spec=off is measured."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.bench.client import tokenize_prompts
from eagle3.core.common import Eagle3Error
from eagle3.core.config import Config
from eagle3.core.drafter_io import check_folder_for_target
from eagle3.core.spec import Spec, resolve_spec
from eagle3.core.target import (
    folder_text_config,
    latent_attention,
    target_path_for,
    target_tokenizer,
)
from eagle3.data.suites import check_bench_settings, load_suite, suite_name
from eagle3.serve import inprocess
from eagle3.serve.launch import check_spec_for_engine


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
