"""HTTP server for the embedded decoder: `python -m eagle3.engine.server <hydra overrides>`.

Routes: SGLang-native POST /generate, OpenAI POST /v1/completions and /v1/chat/completions
(non-streaming and SSE streaming), GET /v1/models, GET /health, GET /stats (cumulative
acceptance counters, named like vLLM's spec-decode metrics). With engine.max_batch_size 1 one
request decodes at a time (the fused batch-1 decoder; requests queue on a lock); above 1 up to that
many share each step (engine/scheduler.py, continuous batching). Bad requests answer 400 naming the
field (or the first bad token id) and the server keeps serving. A client that disconnects cancels
its generation within one step. With serve.api_key_env naming a set variable every route but
/health needs that key (`Authorization: Bearer <key>`). SIGTERM stops gracefully: new requests get
503, requests in flight finish (or are cancelled after serve.grace_s) and the process exits 0.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
import socket
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Annotated

import torch
from fastapi import Request
from omegaconf import DictConfig
from pydantic import BaseModel, ConfigDict, Field

from eagle3.common import Eagle3Error, api_key, app, log
from eagle3.drafter import build_drafter
from eagle3.drafter_io import attach_target_embedding, check_drafter_for_target, load_drafter
from eagle3.engine.decoder import GenerationResult, RequestStats, SpecDecoder
from eagle3.outputs import resolve_drafter_path
from eagle3.spec import resolve_spec
from eagle3.target import load_target

# ---------------------------------------------------------------- request schemas


class Strict(BaseModel):
    model_config = ConfigDict(extra="ignore")


# A per-request sampling seed (vLLM's and OpenAI's `seed`): an integer in torch.Generator's range.
Seed = Annotated[int | None, Field(ge=0, lt=2**64, strict=True)]


class SamplingParams(Strict):
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: Seed = None


class GenerateRequest(Strict):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = SamplingParams()
    stream: bool = False


class OpenAIRequest(Strict):
    """The fields the OpenAI completions and chat bodies share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: Seed = None
    stream: bool = False
    ignore_eos: bool = (
        False  # an extension SGLang's and vLLM's OpenAI routes accept too (benchmarks send it)
    )


class CompletionRequest(OpenAIRequest):
    prompt: str | list[int]


class Message(Strict):
    role: str
    content: str


class ChatRequest(OpenAIRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


# ---------------------------------------------------------------- the engine behind the routes


@dataclass
class Reply:
    tokens: list[int]
    text: str
    finish_reason: str
    result: GenerationResult
    latency_s: float


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
        self.num_draft_tokens += s.draft_tokens_per_step * s.verify_steps
        self.num_accepted_tokens += sum(s.accepted_per_step)
        per_pos = s.accepted_per_position
        self.accepted_per_pos += [0] * (len(per_pos) - len(self.accepted_per_pos))
        for index, count in enumerate(per_pos):
            self.accepted_per_pos[index] += count
        self.draft_time_s += s.draft_time_s
        self.verify_time_s += s.verify_time_s


class EngineService:
    """The decoder, its tokenizer and the cumulative counters; generate() serialises requests."""

    def __init__(
        self,
        decoder: SpecDecoder,
        tokenizer,
        scfg: DictConfig,
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

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_chat(self, messages: list[Message]) -> list[int]:
        return self.tokenizer.apply_chat_template(
            [m.model_dump() for m in messages],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int | None,
        temperature: float | None,
        top_p: float,
        stop: str | list[str] | None = None,
        stop_token_ids=(),
        ignore_eos: bool = False,
        on_text=None,
        seed: int | None = None,
        cancel: threading.Event | None = None,
    ) -> Reply:
        """Decode under the lock; on_text(delta) streams text as steps commit, never text a stop
        string may still remove. seed: this request's own sampling generator (same seed, same text).
        cancel: set it (a disconnected client) and decoding stops after the current step."""
        self.check_request(prompt_ids, max_new_tokens, stop_token_ids)
        with self.idle:
            self.active += 1
        try:
            return self._generate(
                prompt_ids,
                max_new_tokens,
                temperature,
                top_p,
                stop,
                stop_token_ids,
                ignore_eos,
                on_text,
                seed,
                cancel or threading.Event(),
            )
        finally:
            with self.idle:
                self.active -= 1
                self.idle.notify_all()

    def cancelled(self, cancel: threading.Event) -> bool:
        return cancel.is_set() or self.cancel_all.is_set()

    def _generate(
        self,
        prompt_ids,
        max_new_tokens,
        temperature,
        top_p,
        stop,
        stop_token_ids,
        ignore_eos,
        on_text,
        seed,
        cancel: threading.Event,
    ) -> Reply:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        stop_ids = set(stop_token_ids or ())
        if not ignore_eos and self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)
        produced: list[int] = []
        sent = [""]

        def on_tokens(new: list[int]) -> bool:
            produced.extend(new)
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
                stats = RequestStats(prompt_tokens=len(prompt_ids))
                return Reply([], "abort", GenerationResult([], "abort", stats), 0.0)
            result = self.decoder.generate(
                prompt_ids,
                max_new_tokens or self.scfg.default_max_tokens,
                self.scfg.default_temperature if temperature is None else temperature,
                top_p,
                stop_ids=stop_ids,
                on_tokens=on_tokens,
                generator=torch.Generator().manual_seed(seed) if seed is not None else None,
            )
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

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def stats(self) -> dict:
        c = self.counters
        return {
            **c.__dict__,
            "tau": c.completion_tokens / c.num_drafts if c.num_drafts else 0.0,
            "spec": self.decoder.spec.label,
            "drafter": self.drafter_source,
            "max_context": self.decoder.max_context,
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


# ---------------------------------------------------------------- the FastAPI app


class Gate:
    """ASGI middleware in front of every route: 503 while draining (SIGTERM), 401 without the
    API key (compared in constant time; /health stays open so a supervisor can poll it)."""

    def __init__(self, app, service: EngineService):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        from fastapi.responses import JSONResponse

        refusal = None
        if scope["type"] == "http":
            refusal = self.refusal(scope)
        if refusal is None:
            return await self.app(scope, receive, send)
        status, kind, message = refusal
        headers = {"Connection": "close"} if status == 503 else {}
        body = {"error": {"message": message, "type": kind}}
        await JSONResponse(body, status, headers=headers)(scope, receive, send)

    def refusal(self, scope) -> tuple[int, str, str] | None:
        if self.service.draining:
            return 503, "unavailable", "the server is shutting down"
        key = self.service.api_key
        if key is None or scope["path"] == "/health":
            return None
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").removeprefix(b"Bearer ").strip()
        given = given or headers.get(b"x-api-key", b"")
        if not hmac.compare_digest(given, key.encode()):
            return 401, "unauthorized", "missing or wrong API key (Authorization: Bearer <key>)"
        return None


async def watch_disconnect(request, cancel: threading.Event, poll_s: float) -> None:
    """Set cancel as soon as the client has gone (checked every poll_s)."""
    while not cancel.is_set():
        if await request.is_disconnected():
            cancel.set()
            return
        await asyncio.sleep(poll_s)


async def answer(request, run, poll_s: float):
    """run(on_text=None, cancel=event) in a worker thread; a client that disconnects meanwhile
    cancels it."""
    from starlette.concurrency import run_in_threadpool

    cancel = threading.Event()
    watcher = asyncio.ensure_future(watch_disconnect(request, cancel, poll_s))
    try:
        return await run_in_threadpool(lambda: run(cancel=cancel))
    finally:
        cancel.set()
        watcher.cancel()


def create_app(service: EngineService):
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    api = FastAPI(title="eagle3 local engine")
    api.add_middleware(Gate, service=service)
    poll_s = service.scfg.disconnect_poll_s

    @api.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, err: RequestValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
            for e in err.errors()
        )
        return JSONResponse(
            {"error": {"message": f"invalid request: {problems}", "type": "invalid_request"}}, 400
        )

    @api.exception_handler(Eagle3Error)
    async def engine_refused(_request: Request, err: Eagle3Error):
        return JSONResponse({"error": {"message": str(err), "type": "invalid_request"}}, 400)

    @api.exception_handler(Exception)
    async def engine_failed(_request: Request, err: Exception):
        log.exception("request failed")
        message = f"internal error: {type(err).__name__}: {err}"
        return JSONResponse({"error": {"message": message, "type": "internal"}}, 500)

    @api.get("/health")
    def health():
        return {"status": "ok"}

    @api.get("/stats")
    def stats():
        return service.stats()

    @api.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [{"id": service.model_name, "object": "model", "owned_by": "eagle3"}],
        }

    @api.post("/generate")
    async def generate(req: GenerateRequest, request: Request):
        if (req.text is None) == (req.input_ids is None):
            raise Eagle3Error("give exactly one of text or input_ids")
        ids = req.input_ids if req.input_ids is not None else service.encode_text(req.text)
        sp = req.sampling_params
        service.check_request(ids, sp.max_new_tokens, sp.stop_token_ids)
        run = lambda on_text=None, cancel=None: service.generate(
            ids,
            sp.max_new_tokens,
            sp.temperature,
            sp.top_p,
            sp.stop,
            sp.stop_token_ids,
            sp.ignore_eos,
            on_text,
            sp.seed,
            cancel,
        )
        if req.stream:
            return stream(
                request,
                run,
                lambda delta, reply: {
                    "text": delta,
                    **({"meta_info": meta(reply)} if reply else {}),
                },
            )
        reply = await answer(request, run, poll_s)
        return {"text": reply.text, "output_ids": reply.tokens, "meta_info": meta(reply)}

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        ids = req.prompt if isinstance(req.prompt, list) else service.encode_text(req.prompt)
        service.check_request(ids, req.max_tokens, ())
        run = lambda on_text=None, cancel=None: service.generate(
            ids,
            req.max_tokens,
            req.temperature,
            req.top_p,
            req.stop,
            ignore_eos=req.ignore_eos,
            on_text=on_text,
            seed=req.seed,
            cancel=cancel,
        )
        make = lambda choices: openai_body("text_completion", service.model_name, choices)
        if req.stream:
            return stream(
                request,
                run,
                lambda delta, reply: make(
                    [
                        {
                            "index": 0,
                            "text": delta,
                            "finish_reason": reply.finish_reason if reply else None,
                        }
                    ]
                ),
                done=True,
            )
        reply = await answer(request, run, poll_s)
        body = make(
            [
                {
                    "index": 0,
                    "text": reply.text,
                    "finish_reason": reply.finish_reason,
                    "logprobs": None,
                }
            ]
        )
        return {**body, "usage": usage(reply)}

    @api.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        ids = service.encode_chat(req.messages)
        limit = req.max_completion_tokens or req.max_tokens
        service.check_request(ids, limit, ())
        run = lambda on_text=None, cancel=None: service.generate(
            ids,
            limit,
            req.temperature,
            req.top_p,
            req.stop,
            ignore_eos=req.ignore_eos,
            on_text=on_text,
            seed=req.seed,
            cancel=cancel,
        )
        if req.stream:
            return stream(
                request,
                run,
                lambda delta, reply: openai_body(
                    "chat.completion.chunk",
                    service.model_name,
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": delta} if delta else {},
                            "finish_reason": reply.finish_reason if reply else None,
                        }
                    ],
                ),
                done=True,
            )
        reply = await answer(request, run, poll_s)
        body = openai_body(
            "chat.completion",
            service.model_name,
            [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply.text},
                    "finish_reason": reply.finish_reason,
                }
            ],
        )
        return {**body, "usage": usage(reply)}

    def stream(request, run, chunk, done: bool = False):
        """Server-sent events: one chunk per committed step's text, then a final chunk. A client
        that disconnects (or a closed stream) cancels the generation within one step."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        put = lambda item: loop.call_soon_threadsafe(events.put_nowait, item)

        def work():
            try:
                reply = run(lambda delta: put(("delta", delta)), cancel)
                put(("end", reply))
            except Exception as err:  # reported in-band: the status line has been sent
                put(("error", err))

        threading.Thread(target=work, daemon=True).start()

        async def lines():
            watcher = asyncio.ensure_future(watch_disconnect(request, cancel, poll_s))
            try:
                while True:
                    kind, value = await events.get()
                    if kind == "delta":
                        yield f"data: {json.dumps(chunk(value, None))}\n\n"
                    elif kind == "end":
                        yield f"data: {json.dumps(chunk('', value))}\n\n"
                        break
                    else:
                        yield f"data: {json.dumps({'error': {'message': str(value)}})}\n\n"
                        break
                if done:
                    yield "data: [DONE]\n\n"
            finally:
                cancel.set()
                watcher.cancel()

        return StreamingResponse(lines(), media_type="text/event-stream")

    return api


def meta(reply: Reply) -> dict:
    s = reply.result.stats
    return {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "spec_verify_ct": s.verify_steps,
        "spec_accept_length": s.tau,
        "finish_reason": {
            "type": reply.finish_reason,
            **({"length": s.completion_tokens} if reply.finish_reason == "length" else {}),
        },
        "e2e_latency": reply.latency_s,
        "draft_time_s": s.draft_time_s,
        "verify_time_s": s.verify_time_s,
        "accepted_per_step": s.accepted_per_step,
    }


def usage(reply: Reply) -> dict:
    s = reply.result.stats
    return {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
    }


def openai_body(kind: str, model: str, choices: list[dict]) -> dict:
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:16]}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


# ---------------------------------------------------------------- building and running


def load_engine_drafter(cfg: DictConfig, target, spec):
    """(drafter or None, where it came from). An exported drafter when one is configured or was
    trained for this config; without one, serve.drafter_fallback=untrained builds a fresh one."""
    if not spec.enabled:
        return None, "none (spec=off)"
    try:
        path = resolve_drafter_path(cfg, engine="local")
    except Eagle3Error:
        if cfg.drafter.get("path") or cfg.serve.drafter_fallback != "untrained":
            raise
        log.warning(
            "no exported drafter for this config: serving an UNTRAINED drafter (acceptance ~1; "
            "serve.drafter_fallback=untrained)"
        )
        dtype = next(target.model.parameters()).dtype
        with torch.random.fork_rng(
            devices=[]
        ):  # the same weights at every start: seeded requests reproduce
            torch.manual_seed(cfg.seed)
            drafter = build_drafter(target, cfg.drafter)
        return drafter.to(dtype).eval(), "untrained"
    drafter = load_drafter(path, device=target.device)
    if getattr(drafter.config, "has_embedding", False):
        check_drafter_for_target(drafter, target)
    else:
        attach_target_embedding(drafter, target)
    dtype = next(target.model.parameters()).dtype
    return drafter.to(device=target.device, dtype=dtype).eval(), str(path)


def build_service(cfg: DictConfig) -> EngineService:
    if cfg.engine.get("cpu_threads"):
        torch.set_num_threads(int(cfg.engine.cpu_threads))
    spec = resolve_spec(cfg.spec)
    target = load_target(cfg)
    drafter, source = load_engine_drafter(cfg, target, spec)
    graphs = cfg.engine.cuda_graphs
    use_graphs = target.device.type == "cuda" if graphs == "auto" else bool(graphs)
    compile_layers, compile_draft = (
        use_graphs if setting == "auto" else bool(setting)
        for setting in (cfg.engine.compile_layers, cfg.engine.compile_draft)
    )
    max_batch = int(cfg.engine.get("max_batch_size") or 1)
    if max_batch > 1:
        return batched_service(cfg, target, drafter, spec, source, max_batch)
    decoder = SpecDecoder(
        target,
        drafter,
        spec,
        max_context=cfg.engine.max_context,
        cuda_graphs=use_graphs,
        seed=cfg.engine.seed,
        lean=cfg.engine.lean_forward,
        eager_cudnn=cfg.engine.eager_cudnn_attention,
        compile_layers=compile_layers,
        prefill_graphs=tuple(cfg.engine.prefill_graphs or ()),
        compile_draft=compile_draft,
        overlap_steps=cfg.engine.overlap_steps,
        draft_attention=cfg.engine.draft_attention,
        compile_prefill=cfg.engine.compile_prefill,
        tree_temperature=cfg.engine.tree_temperature,
    )
    log.info(
        "engine ready: target %s (%s forward), spec %s, drafter %s, context %d",
        cfg.target.name,
        "lean" if decoder.target_run.lean else "HF",
        spec.label,
        source,
        decoder.max_context,
    )
    return EngineService(decoder, target.tokenizer, cfg.serve, source, cfg.target.name)


def batched_service(cfg: DictConfig, target, drafter, spec, source: str, max_batch: int):
    """The service over a BatchScheduler: up to max_batch requests share each step."""
    from eagle3.engine.batch import BatchDecoder
    from eagle3.engine.scheduler import BatchScheduler

    decoder = BatchDecoder(
        target,
        drafter,
        spec,
        max_batch,
        max_context=cfg.engine.max_context,
        seed=cfg.engine.seed,
        draft_attention=cfg.engine.draft_attention,
        tree_temperature=cfg.engine.tree_temperature,
    )
    log.info(
        "engine ready: target %s, spec %s, drafter %s, context %d, batches up to %d requests",
        cfg.target.name,
        spec.label,
        source,
        decoder.max_context,
        max_batch,
    )
    scheduler = BatchScheduler(decoder)
    return EngineService(scheduler, target.tokenizer, cfg.serve, source, cfg.target.name)


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def graceful_server(config, service: EngineService, grace_s: float):
    """A uvicorn server whose SIGTERM drains (503 to new requests, in-flight ones finish or are
    cancelled after grace_s) and then exits 0; SIGINT keeps uvicorn's behaviour."""
    import uvicorn

    class Graceful(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if sig != signal.SIGTERM:
                return super().handle_exit(sig, frame)
            if not service.draining:
                log.warning("SIGTERM: refusing new requests, draining (grace %.0fs)", grace_s)
                service.draining = True
                threading.Thread(target=self.drain, daemon=True).start()

        def drain(self):
            service.drain(grace_s)
            self.should_exit = True

    return Graceful(config)


@app
def main(cfg: DictConfig) -> None:
    import uvicorn

    service = build_service(cfg)
    service.api_key = api_key(cfg.serve)
    sock = bind(cfg.serve.host, int(cfg.serve.port))
    host, port = sock.getsockname()[:2]
    print(f"eagle3 local engine serving on http://{host}:{port}", flush=True)
    config = uvicorn.Config(
        create_app(service),
        log_level=cfg.serve.log_level,
        timeout_graceful_shutdown=cfg.serve.grace_s,
    )
    graceful_server(config, service, cfg.serve.grace_s).run(sockets=[sock])


if __name__ == "__main__":
    main()
