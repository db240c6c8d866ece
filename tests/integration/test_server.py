"""The engine's HTTP server on tiny-llama: native and OpenAI routes, streaming, stats counters
consistent with the responses, bad requests answered 400 while the server keeps serving."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import time

import httpx
import pytest
import torch
from engine_helpers import reference_greedy
from fastapi.testclient import TestClient
from support import server_cfg

from eagle3.core.common import Eagle3Error
from eagle3.engine.service import service_for, streamable
from eagle3.serve.launch import free_port
from eagle3.serve.server import create_app


@pytest.fixture(scope="module")
def server(test_root):
    before = torch.get_num_threads()
    service = service_for(server_cfg(test_root))
    with TestClient(create_app(service)) as client:
        yield client, service
    torch.set_num_threads(before)


def test_generate_is_greedy_and_counted(server):
    client, service = server
    prompt = service.encode_text("Hello there")
    expected = reference_greedy(service.decoder.target.model, prompt, 12)
    before = client.get("/stats").json()
    reply = client.post(
        "/generate",
        json={
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        },
    ).json()
    assert reply["output_ids"] == expected and reply["text"] == service.decode(expected)
    meta = reply["meta_info"]
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 12
    assert meta["finish_reason"]["type"] == "length" and meta["e2e_latency"] > 0
    after = client.get("/stats").json()
    assert after["requests"] - before["requests"] == 1
    assert after["completion_tokens"] - before["completion_tokens"] == 12
    assert after["num_drafts"] - before["num_drafts"] == meta["spec_verify_ct"]
    assert after["num_draft_tokens"] - before["num_draft_tokens"] == 3 * meta["spec_verify_ct"]
    assert after["num_accepted_tokens"] - before["num_accepted_tokens"] == sum(
        meta["accepted_per_step"]
    )
    assert after["drafter"] == "untrained" and after["spec"] == "d4"


def test_engine_settings_reach_the_decoder(test_root):
    """engine.tree_temperature from the command line to the served decoder; a bad value names the key."""
    before = torch.get_num_threads()
    try:
        service = service_for(server_cfg(test_root, "spec=d6s3k2", "engine.tree_temperature=0.5"))
        assert service.decoder.tree_temperature == 0.5 and service.decoder.spec.topk == 2
        with pytest.raises(Eagle3Error, match="engine.tree_temperature=0.0: must be > 0"):
            service_for(server_cfg(test_root, "engine.tree_temperature=0"))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_routes_take_ignore_eos(server, route):
    """The tiny random target never picks EOS by itself, so its greedy first token is made the
    tokenizer's EOS (a simulated EOS): without ignore_eos the reply stops there, with it it runs on."""
    client, service = server
    body = {"max_tokens": 6, "temperature": 0}
    body.update(
        {"prompt": "Hello there"}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "Hello there"}]}
    )
    prompt = (
        service.encode_text("Hello there")
        if route == "/v1/completions"
        else service.encode_chat([{"role": "user", "content": "Hello there"}])
    )
    first = reference_greedy(service.decoder.target.model, prompt, 1)[0]
    eos, service.tokenizer.eos_token_id = service.tokenizer.eos_token_id, first
    try:
        stopped = client.post(route, json=body).json()
        running = client.post(route, json={**body, "ignore_eos": True}).json()
    finally:
        service.tokenizer.eos_token_id = eos
    assert service.tokenizer.eos_token_id == eos
    assert (
        stopped["choices"][0]["finish_reason"] == "stop"
        and stopped["usage"]["completion_tokens"] == 1
    )
    assert (
        running["choices"][0]["finish_reason"] == "length"
        and running["usage"]["completion_tokens"] == 6
    )


def test_text_prompt_and_stop_string(server):
    client, service = server
    full = client.post(
        "/generate",
        json={
            "text": "Hello there",
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
        },
    ).json()["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = client.post(
        "/generate",
        json={
            "text": "Hello there",
            "sampling_params": {
                "max_new_tokens": 10,
                "temperature": 0,
                "ignore_eos": True,
                "stop": [stop],
            },
        },
    ).json()
    assert (
        cut["text"] == full[: full.find(stop)]
        and cut["meta_info"]["finish_reason"]["type"] == "stop"
    )


def test_openai_completions_and_chat(server):
    client, service = server
    prompt = service.encode_text("The capital of France is")
    expected = service.decode(reference_greedy(service.decoder.target.model, prompt, 8))
    body = client.post(
        "/v1/completions", json={"model": "x", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    ).json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] <= 8
    assert expected.startswith(body["choices"][0]["text"])
    chat = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0},
    ).json()
    assert (
        chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    )
    assert chat["usage"]["prompt_tokens"] == len(
        service.encode_chat([{"role": "user", "content": "Hi"}])
    )
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-llama"


def sse(response) -> list:
    return [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")
    ]


def test_streaming_matches_non_streaming(server):
    client, _ = server
    request = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}
    whole = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    events = sse(client.post("/v1/completions", json={**request, "stream": True}))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    chat = sse(
        client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 5,
                "temperature": 0,
                "stream": True,
            },
        )
    )
    assert chat[-1] == "[DONE]" and json.loads(chat[0])["object"] == "chat.completion.chunk"
    native = sse(
        client.post(
            "/generate",
            json={
                "text": "Hi",
                "stream": True,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0},
            },
        )
    )
    assert "meta_info" in json.loads(native[-1])


def brute_force_streamable(text: str, stops: list[str], alphabet: str) -> str:
    """By definition: after a stop string, the text before its first occurrence; else the longest
    text that the final (cut) text starts with whatever characters come next."""
    starts = [i for i in range(len(text)) for s in stops if text.startswith(s, i)]
    if starts:
        return text[: min(starts)]
    longest = max(map(len, stops))
    futures = [
        "".join(c) for n in range(longest + 1) for c in itertools.product(alphabet, repeat=n)
    ]
    finals = []
    for future in futures:
        whole = text + future
        cut = [i for i in range(len(whole)) for s in stops if whole.startswith(s, i)]
        finals.append(whole[: min(cut)] if cut else whole)
    return os.path.commonprefix(finals)


def test_streamable_holds_back_exactly_what_a_stop_string_may_remove():
    rng, alphabet = random.Random(0), "abc"
    word = lambda low, high: "".join(rng.choice(alphabet) for _ in range(rng.randint(low, high)))
    for _ in range(400):
        text, stops = word(0, 9), [word(1, 4) for _ in range(rng.randint(1, 3))]
        safe, hit = streamable(text, stops)
        assert safe == brute_force_streamable(text, stops, alphabet), (text, stops)
        assert hit == any(s in text for s in stops)
    assert streamable("ab\ufffd", []) == (
        "ab",
        False,
    )  # an incomplete character waits for its bytes


def test_streamed_chunks_equal_the_response_with_a_stop_across_tokens(server):
    """Greedy, stop string from the middle of the output spanning two tokens: streamed chunks
    never carry the start of the stop string, so they join to the non-streamed text."""
    client, service = server
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    full = client.post(
        "/generate", json={"text": "Once upon a time", "sampling_params": params}
    ).json()
    bounds = [
        len(service.decode(full["output_ids"][:k])) for k in range(1, len(full["output_ids"]))
    ]
    middle = bounds[len(bounds) // 2]
    stop = full["text"][middle - 2 : middle + 2]
    first = full["text"].find(stop)
    assert any(
        first < b < first + len(stop) for b in bounds
    )  # the stop string spans a token boundary
    native = {"text": "Once upon a time", "sampling_params": {**params, "stop": stop}}
    whole = client.post("/generate", json=native).json()["text"]
    streamed = [
        json.loads(e)["text"]
        for e in sse(client.post("/generate", json={**native, "stream": True}))
    ]
    assert "".join(streamed) == whole == full["text"][:first]
    openai = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "stop": [stop]}
    whole = client.post("/v1/completions", json=openai).json()["choices"][0]["text"]
    events = sse(client.post("/v1/completions", json={**openai, "stream": True}))[:-1]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events) == whole


SEEDED = [
    (
        "/generate",
        lambda seed: {
            "text": "Once upon a time",
            "sampling_params": {
                "max_new_tokens": 12,
                "temperature": 1.0,
                "ignore_eos": True,
                **seed,
            },
        },
        lambda r: r["text"],
    ),
    (
        "/v1/completions",
        lambda seed: {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, **seed},
        lambda r: r["choices"][0]["text"],
    ),
    (
        "/v1/chat/completions",
        lambda seed: {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 12,
            "temperature": 1.0,
            **seed,
        },
        lambda r: r["choices"][0]["message"]["content"],
    ),
]


def sampled(client, route: str, body, text, **seed) -> str:
    reply = client.post(route, json=body(seed))
    assert reply.status_code == 200, reply.text
    return text(reply.json())


@pytest.mark.parametrize("route, body, text", SEEDED)
def test_seed_makes_sampling_reproducible(server, route, body, text):
    client, _ = server
    first = sampled(client, route, body, text, seed=7)
    assert sampled(client, route, body, text, seed=7) == first
    assert sampled(client, route, body, text, seed=8) != first
    assert sampled(client, route, body, text) != sampled(
        client, route, body, text
    )  # unseeded: running generator


def test_seed_reproduces_across_restarts(server, test_root):
    client, _ = server
    expected = [sampled(client, *case, seed=11) for case in SEEDED]
    with TestClient(create_app(service_for(server_cfg(test_root)))) as restarted:
        assert [sampled(restarted, *case, seed=11) for case in SEEDED] == expected


@pytest.mark.parametrize("seed", [-1, 1.5, "7", True, 2**64])
@pytest.mark.parametrize(
    "route, body, field",
    [
        (
            "/generate",
            lambda seed: {"text": "hi", "sampling_params": {"seed": seed}},
            "sampling_params.seed",
        ),
        ("/v1/completions", lambda seed: {"prompt": "hi", "seed": seed}, "seed"),
        (
            "/v1/chat/completions",
            lambda seed: {"messages": [{"role": "user", "content": "hi"}], "seed": seed},
            "seed",
        ),
    ],
)
def test_bad_seed_is_400_naming_the_field(server, route, body, field, seed):
    client, _ = server
    reply = client.post(route, json=body(seed))
    assert reply.status_code == 400 and f"{field}: " in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    "payload, field",
    [
        ({"sampling_params": {"max_new_tokens": 4}}, "exactly one of text or input_ids"),
        (
            {"text": "hi", "sampling_params": {"max_new_tokens": 0}},
            "sampling_params.max_new_tokens",
        ),
        ({"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"text": "hi", "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
        ({"input_ids": "abc"}, "input_ids"),
        ({"input_ids": list(range(1, 80))}, "context holds 64"),
    ],
)
def test_bad_requests_are_400_naming_the_field(server, payload, field):
    client, _ = server
    reply = client.post("/generate", json=payload)
    assert reply.status_code == 400 and field in reply.json()["error"]["message"]
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize(
    "route, body, message",
    [
        (
            "/generate",
            lambda vocab, _limit: {
                "input_ids": [1, 2],
                "sampling_params": {"stop_token_ids": [vocab]},
            },
            lambda vocab, _limit: f"stop_token_ids[0] = {vocab} is not a token id",
        ),
        (
            "/v1/completions",
            lambda vocab, _limit: {"prompt": [1, vocab], "max_tokens": 2},
            lambda vocab, _limit: f"input_ids[1] = {vocab} is not a token id",
        ),
        (
            "/v1/chat/completions",
            lambda _vocab, limit: {
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": limit + 1,
            },
            lambda _vocab, limit: (
                f"max_tokens = {limit + 1} exceeds this server's limit of {limit}"
            ),
        ),
    ],
)
def test_a_streaming_request_the_engine_refuses_is_400_before_any_event(
    server, route, body, message
):
    """A stream has sent its status line once decoding starts: the engine's refusal must come
    before, as a 400 with a JSON error, and nothing is decoded or counted."""
    client, service = server
    vocab, limit = service.vocab_size, service.scfg.max_tokens_limit
    before = client.get("/stats").json()["requests"]
    reply = client.post(route, json={**body(vocab, limit), "stream": True})
    assert reply.status_code == 400 and reply.headers["content-type"] == "application/json"
    assert message(vocab, limit) in reply.json()["error"]["message"]
    assert client.get("/stats").json()["requests"] == before


def test_malformed_json_and_chat_fields(server):
    client, _ = server
    reply = client.post(
        "/generate", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert reply.status_code == 400 and "invalid request" in reply.json()["error"]["message"]
    reply = client.post("/v1/chat/completions", json={"messages": []})
    assert reply.status_code == 400 and "messages" in reply.json()["error"]["message"]
    reply = client.post("/v1/completions", json={"max_tokens": 3})
    assert reply.status_code == 400 and "prompt" in reply.json()["error"]["message"]


@pytest.mark.slow
def test_server_process_round_trip(test_root):
    """`python -m eagle3.serve.server` as the bench starts it: a real process on 127.0.0.1."""
    port = free_port("127.0.0.1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eagle3.serve.server",
            f"paths.root={test_root}",
            "target=tiny-llama",
            "spec=d10s5",
            "serve.drafter_fallback=untrained",
            f"serve.port={port}",
            "engine.cpu_threads=1",
            "hydra.run.dir=" + str(test_root / "hydra"),
            "hydra.output_subdir=null",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
            assert proc.poll() is None, proc.stdout.read()
        reply = httpx.post(
            url + "/generate",
            json={
                "text": "Hello",
                "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            },
            timeout=60,
        ).json()
        assert reply["meta_info"]["completion_tokens"] == 6
        stats = httpx.get(url + "/stats").json()
        assert (
            stats["requests"] == 1
            and stats["spec"] == "d10s5k4"
            and stats["num_draft_tokens"] == 9 * reply["meta_info"]["spec_verify_ct"]
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_missing_drafter_is_refused(test_root):
    from eagle3.core.common import Eagle3Error, compose

    cfg = compose(
        [f"paths.root={test_root}", "target=tiny-llama", "drafter.path=/nonexistent/drafter"]
    )
    with pytest.raises(Eagle3Error, match="does not exist"):
        service_for(cfg)


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("/generate", '{"text": "caf\\ud800"}', "text"),
        ("/v1/completions", '{"prompt": "a \\udfff b", "max_tokens": 2}', "prompt"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "\\ud83d"}]}',
            "content",
        ),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(server, route, body, field):
    """JSON may escape half of a UTF-16 pair ("\\ud800"): not text a tokenizer can take."""
    client, _ = server
    reply = client.post(route, content=body.encode(), headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert field in message and "surrogate" in message
    assert client.get("/health").status_code == 200


def test_a_temperature_beyond_float32_samples_uniformly_over_the_allowed_tokens():
    """1e308 is a valid temperature: logits / 1e308 is 0 for every finite logit (uniform), and a
    token masked out with -inf (outside the draft vocabulary) keeps probability 0, not NaN."""
    from eagle3.engine.sampling import probabilities

    logits = torch.tensor([3.0, -1.0, float("-inf"), 0.5])
    for top_p in (1.0, 0.99):
        probs = probabilities(logits, 1e308, top_p)
        assert probs.tolist() == pytest.approx([1 / 3, 1 / 3, 0.0, 1 / 3])


def test_an_infinite_temperature_is_400(server):
    client, _ = server
    body = b'{"text": "hi", "sampling_params": {"temperature": Infinity}}'
    reply = client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "temperature" in reply.json()["error"]["message"]
