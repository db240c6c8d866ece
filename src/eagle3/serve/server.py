"""HTTP server for the embedded decoder: `python -m eagle3.serve.server <hydra overrides>`.

Routes: SGLang-native POST /generate, OpenAI POST /v1/completions and /v1/chat/completions
(non-streaming and SSE streaming), GET /v1/models, GET /health (with the launch token its starter
handed over in EAGLE3_LAUNCH_TOKEN: proof that a health check reached this server), GET /stats (cumulative
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
import os
import signal
import socket
import threading
import time
import uuid
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from eagle3.core.common import Eagle3Error, api_key, app, log
from eagle3.core.config import Config
from eagle3.core.lifecycle import LAUNCH_TOKEN_ENV
from eagle3.engine.service import EngineService, Generation, Reply, service_for

# ---------------------------------------------------------------- request schemas


class Strict(BaseModel):
    model_config = ConfigDict(extra="ignore")


# A per-request sampling seed (vLLM's and OpenAI's `seed`): an integer in torch.Generator's range.
Seed = Annotated[int | None, Field(ge=0, lt=2**64, strict=True)]


class SamplingParams(Strict):
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
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

    def generation(self, service: EngineService) -> Generation:
        """The body as the engine's request: exactly one of text (tokenized) or input_ids."""
        if (self.text is None) == (self.input_ids is None):
            raise Eagle3Error("give exactly one of text or input_ids")
        ids = self.input_ids if self.input_ids is not None else service.encode_text(self.text)
        sp = self.sampling_params
        return Generation(
            ids,
            sp.max_new_tokens,
            sp.temperature,
            sp.top_p,
            stop=sp.stop,
            stop_token_ids=sp.stop_token_ids,
            ignore_eos=sp.ignore_eos,
            seed=sp.seed,
        )


class OpenAIRequest(Strict):
    """The fields the OpenAI completions and chat bodies share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: Seed = None
    stream: bool = False
    ignore_eos: bool = (
        False  # an extension SGLang's and vLLM's OpenAI routes accept too (benchmarks send it)
    )

    def generation_of(self, ids: list[int], max_new_tokens: int | None) -> Generation:
        """The engine's request for the prompt `ids` with these shared fields."""
        return Generation(
            ids,
            max_new_tokens,
            self.temperature,
            self.top_p,
            self.stop,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
        )


class CompletionRequest(OpenAIRequest):
    prompt: str | list[int]

    def generation(self, service: EngineService) -> Generation:
        """A text prompt tokenized, a list of token ids taken as it is."""
        prompt = self.prompt
        ids = prompt if isinstance(prompt, list) else service.encode_text(prompt, "prompt")
        return self.generation_of(ids, self.max_tokens)


class Message(Strict):
    role: str
    content: str


class ChatRequest(OpenAIRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def generation(self, service: EngineService) -> Generation:
        """The messages through the chat template; max_completion_tokens before max_tokens."""
        ids = service.encode_chat([m.model_dump() for m in self.messages])
        return self.generation_of(ids, self.max_completion_tokens or self.max_tokens)


# ---------------------------------------------------------------- the engine behind the routes


class Gate:
    """ASGI middleware in front of every route: 503 while draining (SIGTERM), 401 without the
    API key (compared in constant time; /health stays open so a supervisor can poll it)."""

    def __init__(self, app, service: EngineService):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
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


def create_app(service: EngineService) -> FastAPI:
    api = FastAPI(title="eagle3 local engine")
    api.add_middleware(Gate, service=service)
    add_error_handlers(api)
    add_info_routes(api, service)
    add_generate_route(api, service)
    add_completions_route(api, service)
    add_chat_route(api, service)
    return api


# ---------------------------------------------------------------- errors


async def bad_request(_request: Request, err: RequestValidationError) -> JSONResponse:
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
        for e in err.errors()
    )
    return JSONResponse(
        {"error": {"message": f"invalid request: {problems}", "type": "invalid_request"}}, 400
    )


async def engine_refused(_request: Request, err: Eagle3Error) -> JSONResponse:
    return JSONResponse({"error": {"message": str(err), "type": "invalid_request"}}, 400)


async def engine_failed(_request: Request, err: Exception) -> JSONResponse:
    log.exception("request failed")
    message = f"internal error: {type(err).__name__}: {err}"
    return JSONResponse({"error": {"message": message, "type": "internal"}}, 500)


def add_error_handlers(api: FastAPI) -> None:
    """400 naming the field for a body that fails its schema or a request the engine refuses
    (Eagle3Error); 500 naming the exception for anything else."""
    api.add_exception_handler(RequestValidationError, bad_request)
    api.add_exception_handler(Eagle3Error, engine_refused)
    api.add_exception_handler(Exception, engine_failed)


# ---------------------------------------------------------------- routes


def add_info_routes(api: FastAPI, service: EngineService) -> None:
    """GET /health (with the launch token), /stats (the counters), /v1/models."""
    launch_token = os.environ.get(LAUNCH_TOKEN_ENV)

    @api.get("/health")
    def health():
        return {"status": "ok", "launch": launch_token}

    @api.get("/stats")
    def stats():
        return service.stats()

    @api.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [{"id": service.model_name, "object": "model", "owned_by": "eagle3"}],
        }


def add_generate_route(api: FastAPI, service: EngineService) -> None:
    """SGLang-native POST /generate: text, output ids and meta_info (its SSE chunks carry the text
    delta, the last one the ids and meta_info too)."""

    def chunk(delta: str, reply: Reply | None) -> dict:
        return {
            "text": delta,
            **({"meta_info": meta(reply), "output_ids": reply.tokens} if reply else {}),
        }

    def whole(reply: Reply) -> dict:
        return {"text": reply.text, "output_ids": reply.tokens, "meta_info": meta(reply)}

    @api.post("/generate")
    async def generate(req: GenerateRequest, request: Request):
        return await respond(service, request, req, chunk, whole)


def add_completions_route(api: FastAPI, service: EngineService) -> None:
    """OpenAI POST /v1/completions."""

    def chunk(delta: str, reply: Reply | None) -> dict:
        finish = reply.finish_reason if reply else None
        choice = {"index": 0, "text": delta, "finish_reason": finish}
        return openai_body("text_completion", service.model_name, [choice])

    def whole(reply: Reply) -> dict:
        choice = {
            "index": 0,
            "text": reply.text,
            "finish_reason": reply.finish_reason,
            "logprobs": None,
        }
        body = openai_body("text_completion", service.model_name, [choice])
        return {**body, "usage": usage(reply)}

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await respond(service, request, req, chunk, whole, done=True)


def add_chat_route(api: FastAPI, service: EngineService) -> None:
    """OpenAI POST /v1/chat/completions."""

    def chunk(delta: str, reply: Reply | None) -> dict:
        finish = reply.finish_reason if reply else None
        message = {"role": "assistant", "content": delta} if delta else {}
        choice = {"index": 0, "delta": message, "finish_reason": finish}
        return openai_body("chat.completion.chunk", service.model_name, [choice])

    def whole(reply: Reply) -> dict:
        message = {"role": "assistant", "content": reply.text}
        choice = {"index": 0, "message": message, "finish_reason": reply.finish_reason}
        body = openai_body("chat.completion", service.model_name, [choice])
        return {**body, "usage": usage(reply)}

    @api.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        return await respond(service, request, req, chunk, whole, done=True)


# ---------------------------------------------------------------- answering a generation


def admit(
    service: EngineService, req: GenerateRequest | CompletionRequest | ChatRequest
) -> Generation:
    """The body as a Generation, checked before anything is decoded: a stream has sent its status
    line by the time the engine could refuse it, so a bad request is a 400 only from here."""
    generation = req.generation(service)
    service.check_request(
        generation.prompt_ids, generation.max_new_tokens, generation.stop_token_ids
    )
    return generation


async def respond(service: EngineService, request: Request, req, chunk, whole, done: bool = False):
    """Decode the body's generation: a server-sent event per chunk(delta, None), then
    chunk("", reply) (and "[DONE]" when done) for a streaming body; else whole(reply)."""
    generation = admit(service, req)
    run = lambda on_text=None, cancel=None: service.generate(generation, on_text, cancel)
    poll_s = service.scfg.disconnect_poll_s
    if req.stream:
        return stream(request, run, chunk, poll_s, done)
    return whole(await answer(request, run, poll_s))


def stream(request, run, chunk, poll_s: float, done: bool = False) -> StreamingResponse:
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
def main(cfg: Config) -> None:
    import uvicorn

    service = service_for(cfg)
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
