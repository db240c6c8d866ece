"""The embedded engine without its HTTP front: the decoder (the fused batch-1 SpecDecoder, or a
BatchScheduler over a BatchDecoder), its tokenizer and cumulative acceptance counters. The server
(eagle3.serve.server) puts routes in front of it; the bench's in-process mode calls it directly.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3.core.common import Eagle3Error, log
from eagle3.core.config import Config, DrafterConfig, EngineConfig, ServeConfig
from eagle3.core.drafter import build_drafter
from eagle3.core.drafter_io import attach_target_embedding, check_drafter_for_target, load_drafter
from eagle3.core.outputs import resolve_drafter_path
from eagle3.core.spec import Spec, resolve_spec
from eagle3.core.target import Target, load_target
from eagle3.engine.batch_decoder import BatchDecoder
from eagle3.engine.decoder import DecodeRequest, GenerationResult, RequestStats, SpecDecoder
from eagle3.engine.options import DecoderOptions
from eagle3.engine.schedule import schedule_for
from eagle3.engine.scheduler import BatchScheduler


@dataclass
class Reply:
    tokens: list[int]
    text: str
    finish_reason: str
    result: GenerationResult
    latency_s: float


@dataclass
class Generation:
    """One request's decoding settings, as a route (or an in-process caller) gives them: None for
    max_new_tokens and temperature takes the server's defaults (serve.default_max_tokens,
    serve.default_temperature); seed gives the request its own sampling generator."""

    prompt_ids: list[int]
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class Counters:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_drafts: int = 0  # verify steps
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    def add(self, result: GenerationResult) -> None:
        s = result.stats
        self.requests += 1
        self.prompt_tokens += s.prompt_tokens
        self.completion_tokens += s.completion_tokens
        self.num_drafts += s.verify_steps
        self.num_draft_tokens += s.verified_drafts
        self.num_accepted_tokens += sum(s.accepted_per_step)
        per_pos = s.accepted_per_position
        self.accepted_per_pos += [0] * (len(per_pos) - len(self.accepted_per_pos))
        for index, count in enumerate(per_pos):
            self.accepted_per_pos[index] += count
        self.draft_time_s += s.draft_time_s
        self.verify_time_s += s.verify_time_s


def check_unicode(text: str, field: str) -> None:
    """Refuse (400) text holding half of a UTF-16 surrogate pair: JSON can escape one ("\\ud800"),
    but it is not a character, and no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise Eagle3Error(
            f"{field}: a lone surrogate {text[err.start]!r} at character {err.start} is not valid "
            "Unicode (send both halves of a surrogate pair, or the character itself)"
        ) from None


class EngineService:
    """The decoder, its tokenizer and the cumulative counters; generate() serialises requests."""

    def __init__(
        self,
        decoder: SpecDecoder,
        tokenizer,
        scfg: ServeConfig,
        drafter_source: str,
        model_name: str,
    ):
        self.decoder, self.tokenizer, self.scfg = decoder, tokenizer, scfg
        self.drafter_source, self.model_name = drafter_source, model_name
        self.counters = Counters()
        self.lock = threading.Lock()
        self.active = 0  # requests accepted and not yet answered (queued or decoding)
        self.idle = threading.Condition()
        self.draining = False  # SIGTERM received: new requests get 503
        self.cancel_all = threading.Event()  # the grace period ran out: stop every generation
        self.api_key: str | None = None  # clients must send it (serve.api_key_env)
        # a BatchScheduler wraps the decoder that holds the target
        self.vocab_size = getattr(decoder, "decoder", decoder).target.vocab_size

    def check_request(self, prompt_ids: list[int], max_new_tokens: int | None, stop_ids) -> None:
        """Refuse (400) token ids outside the target's vocabulary (on a GPU they would be a
        device-side assert for everyone) and completions longer than serve.max_tokens_limit."""
        vocab = self.vocab_size
        for name, ids in (("input_ids", prompt_ids), ("stop_token_ids", stop_ids or ())):
            for index, token in enumerate(ids):
                if not 0 <= token < vocab:
                    raise Eagle3Error(
                        f"{name}[{index}] = {token} is not a token id of this target "
                        f"(0..{vocab - 1})"
                    )
        limit = self.scfg.max_tokens_limit
        if max_new_tokens is not None and max_new_tokens > limit:
            raise Eagle3Error(
                f"max_tokens = {max_new_tokens} exceeds this server's limit of {limit} "
                "(serve.max_tokens_limit)"
            )
        self.decoder.check_prompt(prompt_ids)

    def drain(self, grace_s: float) -> None:
        """Wait up to grace_s for the requests in flight, then cancel the rest (each stops within
        one step) and wait for their answers to be sent."""
        with self.idle:
            if not self.idle.wait_for(lambda: self.active == 0, timeout=grace_s):
                log.warning("grace period over: cancelling %d request(s)", self.active)
                self.cancel_all.set()
                self.idle.wait_for(lambda: self.active == 0, timeout=grace_s)

    def encode_text(self, text: str, field: str = "text") -> list[int]:
        check_unicode(text, field)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        for index, message in enumerate(messages):
            check_unicode(message["content"], f"messages.{index}.content")
        return self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]

    def generate(
        self, request: Generation, on_text=None, cancel: threading.Event | None = None
    ) -> Reply:
        """Decode under the lock; on_text(delta) streams text as steps commit, never text a stop
        string may still remove. Same seed, same text. cancel: set it (a disconnected client) and
        decoding stops after the current step."""
        self.check_request(request.prompt_ids, request.max_new_tokens, request.stop_token_ids)
        with self.idle:
            self.active += 1
        try:
            return self._generate(request, on_text, cancel or threading.Event())
        finally:
            with self.idle:
                self.active -= 1
                self.idle.notify_all()

    def cancelled(self, cancel: threading.Event) -> bool:
        return cancel.is_set() or self.cancel_all.is_set()

    def _generate(self, request: Generation, on_text, cancel: threading.Event) -> Reply:
        stop = request.stop
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        produced: list[int] = []
        sent = [""]

        def on_tokens(new: list[int]) -> bool:
            produced.extend(new)
            if not stops and on_text is None:  # nothing reads the text while decoding
                return self.cancelled(cancel)
            text, hit = streamable(self.decode(produced), stops)
            if on_text is not None and len(text) > len(sent[0]):
                on_text(text[len(sent[0]) :])
                sent[0] = text
            return hit or self.cancelled(cancel)

        started = time.perf_counter()
        # a SpecDecoder decodes one request at a time; a BatchScheduler takes concurrent callers
        serial = not getattr(self.decoder, "concurrent", False)
        with self.lock if serial else nullcontext():
            if self.cancelled(cancel):  # gone while queued: nothing decoded
                stats = RequestStats(prompt_tokens=len(request.prompt_ids))
                return Reply([], "abort", GenerationResult([], "abort", stats), 0.0)
            result = self.decoder.generate(self.decode_request(request, on_tokens))
        with self.lock if not serial else nullcontext():
            self.counters.add(result)
        if self.cancelled(cancel):
            result.finish_reason = "abort"
        text, _ = cut_at_stop(self.decode(result.tokens), stops)
        if on_text is not None and len(text) > len(sent[0]):
            on_text(text[len(sent[0]) :])
        return Reply(
            result.tokens, text, result.finish_reason, result, time.perf_counter() - started
        )

    def decode_request(self, request: Generation, on_tokens) -> DecodeRequest:
        """What the decoder takes: the server's defaults where the request left them None, the
        tokenizer's EOS a stop token unless ignore_eos, its own generator where it gave a seed."""
        stop_ids = set(request.stop_token_ids or ())
        if not request.ignore_eos and self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)
        temperature, seed = request.temperature, request.seed
        return DecodeRequest(
            request.prompt_ids,
            request.max_new_tokens or self.scfg.default_max_tokens,
            self.scfg.default_temperature if temperature is None else temperature,
            request.top_p,
            stop_ids=stop_ids,
            on_tokens=on_tokens,
            generator=torch.Generator().manual_seed(seed) if seed is not None else None,
        )

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def stats(self) -> dict:
        c = self.counters
        return {
            **c.__dict__,
            # a copy: an in-process caller keeps this dict while later requests add to the counters
            "accepted_per_pos": list(c.accepted_per_pos),
            "tau": c.completion_tokens / c.num_drafts if c.num_drafts else 0.0,
            "spec": self.decoder.spec.label,
            "drafter": self.drafter_source,
            "max_context": self.decoder.max_context,
            **batching_stats(self.decoder),
        }


def batching_stats(decoder) -> dict:
    """A BatchScheduler's step counts: steps per number of rows and per shape, and the requests
    that started on the batch-1 decoder (empty for the batch-1 decoder itself)."""
    batch = getattr(decoder, "decoder", None)
    if batch is None or not hasattr(batch, "rows_per_step"):
        return {}
    return {
        "max_batch_size": batch.max_batch_size,
        "steps_per_batch_size": {str(k): v for k, v in sorted(batch.rows_per_step.items())},
        "steps_per_shape": dict(batch.shape_steps),
        "schedule": batch.schedule.describe() if batch.schedule.source != "fixed" else None,
        "deterministic": batch.deterministic,
        "alone_requests": decoder.alone,
        "handed_over_requests": decoder.handed_over,
    }


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Text before the first stop string (excluded, as SGLang and OpenAI do), and whether one occurred."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


def streamable(text: str, stops: list[str]) -> tuple[str, bool]:
    """What of `text` may be streamed now, and whether a stop string occurred: the text before the
    first stop string, or else the text less a tail that later tokens could still change (the start
    of a stop string, or an incomplete character, which decodes as U+FFFD)."""
    text, hit = cut_at_stop(text, stops)
    if hit:
        return text, True
    settled = text.rstrip("\ufffd")
    held = max((n for s in stops for n in range(1, len(s)) if settled.endswith(s[:n])), default=0)
    return settled[: len(settled) - held], False


@dataclass(frozen=True)
class DrafterSource:
    """Where the embedded engine's drafter comes from: `find()` gives the exported folder
    (drafter.path, else the config's export; Eagle3Error when there is none), asked only when a
    shape drafts; without one, `untrained` (drafter.*, given when serve.drafter_fallback=untrained
    and drafter.path is empty) builds a fresh drafter, seeded with `seed`."""

    find: Callable[[], Path]
    untrained: DrafterConfig | None
    seed: int


def load_engine_drafter(source: DrafterSource, target, spec):
    """(drafter or None, where it came from). An exported drafter when one is configured or was
    trained for this config; without one, serve.drafter_fallback=untrained builds a fresh one."""
    if not spec.enabled:
        return None, "none (spec=off)"
    try:
        path = source.find()
    except Eagle3Error:
        if source.untrained is None:
            raise
        log.warning(
            "no exported drafter for this config: serving an UNTRAINED drafter (acceptance ~1; "
            "serve.drafter_fallback=untrained)"
        )
        dtype = next(target.model.parameters()).dtype
        with torch.random.fork_rng(
            devices=[]
        ):  # the same weights at every start: seeded requests reproduce
            torch.manual_seed(source.seed)
            drafter = build_drafter(target, source.untrained)
        return drafter.to(dtype).eval(), "untrained"
    drafter = load_drafter(path, device=target.device)
    if getattr(drafter.config, "has_embedding", False):
        check_drafter_for_target(drafter, target)
    else:
        attach_target_embedding(drafter, target)
    dtype = next(target.model.parameters()).dtype
    return drafter.to(device=target.device, dtype=dtype).eval(), str(path)


def drafter_source_for(cfg: Config) -> DrafterSource:
    """How the embedded engine finds a config's drafter: drafter.path or the config's export (by its
    hash, which covers several sections); an untrained one with serve.drafter_fallback=untrained and
    no drafter.path."""
    untrained = not cfg.drafter.path and getattr(cfg.serve, "drafter_fallback", None) == "untrained"
    return DrafterSource(
        functools.partial(resolve_drafter_path, cfg, engine="local"),
        cfg.drafter if untrained else None,
        cfg.seed,
    )


def service_for(cfg: Config) -> EngineService:
    """The embedded engine a config serves: the composition root shared by the local server's
    main and the bench's in-process engine (both hold the job's whole config). It resolves the
    spec, loads the target and binds the drafter's lookup (by drafter.path or the config's export
    hash, which covers several sections)."""
    if cfg.engine.cpu_threads:
        torch.set_num_threads(int(cfg.engine.cpu_threads))
    spec = resolve_spec(cfg.spec)
    target = load_target(cfg.target, cfg.paths.artifacts)
    return build_service(
        cfg.engine,
        cfg.serve,
        spec,
        target,
        drafter_source_for(cfg),
        target_name=cfg.target.name,
        auto_schedule=bool(cfg.spec.schedule),
        concurrency=cfg.bench.batch_size,
    )


def build_service(
    ecfg: EngineConfig,
    scfg: ServeConfig,
    spec: Spec,
    target: Target,
    drafters: DrafterSource,
    *,
    target_name: str,
    auto_schedule: bool,
    concurrency: int | None,
) -> EngineService:
    """The engine serving `target` with `spec`: the batch-1 decoder, or the batched one where
    batches (engine.max_batch_size, at least `concurrency` with auto), a schedule
    (engine.schedule, or spec=auto: `auto_schedule`) or engine.deterministic ask for it."""
    drafter, source = load_engine_drafter(drafters, target, spec)
    schedule = schedule_for(ecfg.schedule, auto_schedule, spec, source)
    wide = [shape for shape in schedule.shapes if shape.enabled] if schedule else []
    if wide and drafter is None:  # spec=off with a schedule file that drafts
        drafter, source = load_engine_drafter(drafters, target, wide[0])
    options = decoder_options(ecfg, target.device)
    max_batch = max_batch_size(ecfg, concurrency, target, drafter)
    forward = how = ""
    if max_batch > 1 or schedule is not None or options.deterministic:
        decoder = batched_decoder(target, drafter, spec, max_batch, options, schedule)
        how = batching_words(max_batch, schedule, options.deterministic)
    else:
        decoder = SpecDecoder(target, drafter, spec, options)
        forward = f" ({'lean' if decoder.target_run.lean else 'HF'} forward)"
    log.info(
        "engine ready: target %s%s, spec %s, drafter %s, context %d%s",
        target_name,
        forward,
        spec.label,
        source,
        decoder.max_context,
        how,
    )
    return EngineService(decoder, target.tokenizer, scfg, source, target_name)


def decoder_options(ecfg: EngineConfig, device: torch.device) -> DecoderOptions:
    """The decoders' options from engine.*, `auto` resolved for `device`: CUDA graphs on a GPU,
    compiled layers and draft phases where graphs replay."""
    graphs = ecfg.cuda_graphs
    use_graphs = device.type == "cuda" if graphs == "auto" else bool(graphs)
    compile_layers, compile_draft = (
        use_graphs if setting == "auto" else bool(setting)
        for setting in (ecfg.compile_layers, ecfg.compile_draft)
    )
    return DecoderOptions(
        max_context=ecfg.max_context,
        seed=ecfg.seed,
        cuda_graphs=use_graphs,
        draft_attention=ecfg.draft_attention,
        tree_temperature=ecfg.tree_temperature,
        lean=ecfg.lean_forward,
        eager_cudnn=ecfg.eager_cudnn_attention,
        compile_layers=compile_layers,
        compile_draft=compile_draft,
        compile_prefill=ecfg.compile_prefill,
        prefill_graphs=tuple(ecfg.prefill_graphs or ()),
        overlap_steps=ecfg.overlap_steps,
        graph_batch_sizes=tuple(ecfg.graph_batch_sizes or ()),
        deterministic=bool(ecfg.deterministic),
    )


def max_batch_size(ecfg: EngineConfig, concurrency: int | None, target, drafter) -> int:
    """engine.max_batch_size, `auto` resolved: the device's default (engine.auto_batch_size), at
    least the bench's concurrency (bench.batch_size); 1 where the batched forwards do not support
    the target or the drafter (the fused batch-1 decoder serves any HF target)."""
    from eagle3.engine.llama import LeanDrafter, LeanLlama

    setting = ecfg.max_batch_size
    concurrency = int(concurrency or 1)
    if setting is None:
        return concurrency
    if str(setting) != "auto":
        return int(setting)
    if not LeanLlama.supports(target.model) or (
        drafter is not None and not LeanDrafter.supports(drafter)
    ):
        log.info("engine.max_batch_size=auto: this target or drafter is not batched; 1 at a time")
        return 1
    per_device = ecfg.auto_batch_size
    device = target.device.type
    if device not in per_device:
        raise Eagle3Error(
            f"engine.max_batch_size=auto: engine.auto_batch_size has no entry for device "
            f"{device!r}; add one or set engine.max_batch_size"
        )
    return max(int(per_device[device]), concurrency)


def batched_decoder(
    target, drafter, spec, max_batch: int, options: DecoderOptions, schedule=None
) -> BatchScheduler:
    """A BatchScheduler: up to max_batch requests share each step, each step runs the schedule's
    shape for its rows (`spec` throughout without one), and a request that finds the engine idle
    runs on the fused batch-1 decoder (not with engine.deterministic, whose numbers only the
    batched forwards give)."""
    decoder = BatchDecoder(target, drafter, spec, max_batch, options, schedule)
    single = None
    if not options.deterministic:
        single = SpecDecoder(target, drafter, decoder.schedule.shape_for(1), options)
    return BatchScheduler(decoder, single)


def batching_words(max_batch: int, schedule, deterministic: bool) -> str:
    """How the batched engine batches, for its ready line."""
    return (
        f", batches up to {max_batch} requests"
        + (f", schedule {schedule.describe()} ({schedule.source})" if schedule else "")
        + (", deterministic (float64)" if deterministic else "")
    )
