"""The local engine server as a real process on tiny-llama: token ids checked before they reach
the model, a max_tokens limit, the API key, generations cancelled when their client goes away,
and SIGTERM draining in-flight requests before exiting 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from eagle3.serve.launch import free_port

KEY = "k-7d1c0e"
VOCAB = 49152  # tiny-llama uses SmolLM2's tokenizer
LONG = 1500  # tokens a long request asks for (spec=off: one step per token)


def start_server(test_root, tmp_path, *overrides: str, env: dict | None = None):
    """`python -m eagle3.serve.server` on a free port; (process, base url) once healthy."""
    port = free_port("127.0.0.1")
    argv = [
        sys.executable,
        "-m",
        "eagle3.serve.server",
        f"paths.root={test_root}",
        "target=tiny-llama",
        "spec=off",
        f"serve.port={port}",
        "engine.cpu_threads=1",
        "engine.max_context=2048",
        f"hydra.run.dir={tmp_path}/hydra",
        "hydra.output_subdir=null",
        *overrides,
    ]
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("server not healthy: " + (tmp_path / "server.log").read_text())


def stop(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def keyed_server(test_root, tmp_path_factory):
    """One server for the module, started with EAGLE3_API_KEY set."""
    proc, url = start_server(
        test_root,
        tmp_path_factory.mktemp("keyed"),
        "serve.max_tokens_limit=2000",
        "serve.disconnect_poll_s=0.05",
        env={"EAGLE3_API_KEY": KEY},
    )
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        yield client
    stop(proc)


def long_request(stream: bool) -> dict:
    return {
        "input_ids": [1, 2, 3],
        "stream": stream,
        "sampling_params": {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True},
    }


def wait_for_requests(client, count: int, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = client.get("/stats").json()
        if stats["requests"] >= count:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} requests finished: {stats}")


@pytest.mark.parametrize(
    "route, body, message",
    [
        ("/generate", {"input_ids": [5, -1, 7, -2]}, "input_ids[1] = -1 "),
        ("/generate", {"input_ids": [5, 6, VOCAB]}, f"input_ids[2] = {VOCAB} "),
        ("/v1/completions", {"prompt": [VOCAB + 10, 3]}, f"input_ids[0] = {VOCAB + 10} "),
        (
            "/generate",
            {"input_ids": [5], "sampling_params": {"stop_token_ids": [2, 10**9]}},
            f"stop_token_ids[1] = {10**9} ",
        ),
        ("/generate", {"input_ids": [5], "stream": True, "sampling_params": {}}, None),
    ],
)
def test_bad_token_ids_are_400_naming_the_first_and_the_connection_stays_usable(
    keyed_server, route, body, message
):
    if message is None:  # a streamed request is checked before its status line too
        body["input_ids"] = [5, VOCAB]
        message = f"input_ids[1] = {VOCAB} "
    reply = keyed_server.post(route, json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == (
        f"{message}is not a token id of this target (0..{VOCAB - 1})"
    )
    ok = keyed_server.post("/generate", json={"input_ids": [5, 6], "sampling_params": {}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["prompt_tokens"] == 2


@pytest.mark.parametrize(
    "route, body",
    [
        ("/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 2001}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2001}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2001},
        ),
    ],
)
def test_max_tokens_above_the_limit_is_400(keyed_server, route, body):
    reply = keyed_server.post(route, json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == (
        "max_tokens = 2001 exceeds this server's limit of 2000 (serve.max_tokens_limit)"
    )


def test_api_key_is_required_except_for_health(keyed_server):
    url = str(keyed_server.base_url)
    body = {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}
    assert httpx.get(url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY[:-1]}):
        reply = httpx.post(url + "/generate", json=body, headers=headers)
        assert reply.status_code == 401 and "API key" in reply.json()["error"]["message"]
        assert httpx.get(url + "/stats", headers=headers).status_code == 401
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        assert httpx.post(url + "/generate", json=body, headers=headers).status_code == 200


def test_a_client_that_disconnects_mid_stream_cancels_its_generation(keyed_server):
    before = keyed_server.get("/stats").json()
    with keyed_server.stream("POST", "/generate", json=long_request(True)) as response:
        lines = response.iter_lines()
        events = []
        for line in lines:
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
            if len(events) == 3:
                break
    gone = time.monotonic()
    stats = wait_for_requests(keyed_server, before["requests"] + 1)
    generated = stats["completion_tokens"] - before["completion_tokens"]
    assert 3 <= generated < LONG // 3, generated  # stopped long before the end
    assert time.monotonic() - gone < 5
    short = {"input_ids": [5], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    reply = keyed_server.post("/generate", json=short, timeout=10)  # not queued behind it
    assert reply.json()["meta_info"]["completion_tokens"] == 4


def test_a_client_that_disconnects_while_waiting_cancels_its_generation(keyed_server):
    before = keyed_server.get("/stats").json()
    with pytest.raises(httpx.ReadTimeout):
        keyed_server.post("/generate", json=long_request(False), timeout=0.5)
    stats = wait_for_requests(keyed_server, before["requests"] + 1, timeout_s=5)
    assert stats["completion_tokens"] - before["completion_tokens"] < LONG // 3


def test_sigterm_refuses_new_requests_cancels_after_the_grace_period_and_exits_0(
    test_root, tmp_path
):
    proc, url = start_server(test_root, tmp_path, "serve.grace_s=1")
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            with client.stream("POST", "/generate", json=long_request(True)) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.3)
                refused = httpx.post(url + "/generate", json={"input_ids": [5]}, timeout=10)
                assert refused.status_code == 503
                assert refused.json()["error"]["message"] == "the server is shutting down"
                last = [json.loads(line[5:]) for line in lines if line.startswith("data:")][-1]
            assert last["meta_info"]["finish_reason"]["type"] == "abort"
            assert last["meta_info"]["completion_tokens"] < LONG
        assert proc.wait(15) == 0
    finally:
        stop(proc)


def test_sigterm_lets_a_request_finish_within_the_grace_period(test_root, tmp_path):
    proc, url = start_server(test_root, tmp_path, "serve.grace_s=60")
    try:
        body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
        with httpx.Client(base_url=url, timeout=60) as client:
            with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                proc.send_signal(signal.SIGTERM)
                last = [json.loads(line[5:]) for line in lines if line.startswith("data:")][-1]
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        assert last["meta_info"]["completion_tokens"] == 300
        assert proc.wait(15) == 0
    finally:
        stop(proc)
