"""Continuous batching (engine/batch_decoder.py): every request's greedy output is the target's own greedy
decode of its prompt alone, whatever else shares its steps (mixed prompt lengths, staggered arrivals,
stop tokens at different steps, a request cancelled mid-stream), trees and acceptance equal the
batch-1 decoder's, sampling keeps the target's distribution, and the server batches concurrent
requests."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_helpers import FALSE_ALARM, PROMPTS, chi_square_p_value, reference_greedy, spec

from eagle3.core.common import Eagle3Error
from eagle3.engine import DecodeRequest, SpecDecoder
from eagle3.engine.batch_decoder import BatchDecoder
from eagle3.engine.options import DecoderOptions

NEW_TOKENS = 40
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest


@pytest.fixture(scope="module")
def fitted(tiny_fitted_drafter):
    return tiny_fitted_drafter


@pytest.fixture(scope="module")
def references(tiny_target):
    """Prompts of different lengths (the four texts, one of them doubled) and their greedy decodes."""
    texts = [*PROMPTS, PROMPTS[0] + " " + PROMPTS[2]]
    prompts = [tiny_target.tokenizer(text)["input_ids"] for text in texts]
    assert len({len(p) for p in prompts}) >= 4
    return [(p, reference_greedy(tiny_target.model, p, NEW_TOKENS)) for p in prompts]


@pytest.mark.parametrize(
    "name, static",
    [
        ("off", False),
        ("d2", False),
        ("d6", False),
        ("d8s4k3", False),
        ("off", True),
        ("d8s4k3", True),
    ],
)
def test_batched_greedy_equals_each_prompt_alone(tiny_target, fitted, references, name, static):
    """Five prompts of different lengths, three rows: requests join as rows free up; each output is
    the target's greedy decode, and each request's accepted lengths are the batch-1 decoder's.
    static: the steps run at the shapes CUDA graphs replay (two and one rows padded to a batch of
    three, power-of-two cache widths)."""
    decoder = BatchDecoder(
        tiny_target,
        fitted,
        spec(name),
        3,
        DecoderOptions(graph_batch_sizes=(), static_shapes=static),
    )
    requests = [decoder.add(DecodeRequest(prompt, NEW_TOKENS)) for prompt, _ in references]
    results = decoder.generate_all(requests)
    single = SpecDecoder(tiny_target, fitted, spec(name), DecoderOptions(fused=False))
    for (prompt, expected), result in zip(references, results):
        assert result.tokens == expected and result.finish_reason == "length"
        alone = single.generate(DecodeRequest(prompt, NEW_TOKENS))
        assert result.stats.accepted_per_step == alone.stats.accepted_per_step
    assert decoder.steps < sum(r.stats.verify_steps for r in results)  # steps were shared
    assert not decoder.busy and not decoder.rows


@pytest.mark.parametrize("static", [False, True])
def test_staggered_arrivals_stops_and_a_cancel(tiny_target, fitted, references, static):
    """Requests arrive at different steps, two stop on a token at different steps, one is cancelled
    after it has streamed 6 tokens; everyone else still gets exactly the greedy decode. static: at
    the padded shapes of CUDA graphs (batches of 1 and 3 padded to 2 and 4)."""
    decoder = BatchDecoder(
        tiny_target,
        fitted,
        spec("d6"),
        4,
        DecoderOptions(graph_batch_sizes=(2,), static_shapes=static),
    )
    arrivals = {0: [0, 1], 2: [2], 3: [3], 5: [4]}  # step -> reference indices
    streamed: dict[int, list[int]] = {}
    requests = {}

    def listener(index):
        def on_tokens(new):
            streamed.setdefault(index, []).extend(new)
            if index == 1 and len(streamed[index]) >= 6:
                requests[index].cancel()
            return False

        return on_tokens

    stops = {2: references[2][1][9], 3: references[3][1][25]}  # stop tokens, hit at different steps
    step = 0
    while step <= max(arrivals) or decoder.busy:
        for index in arrivals.get(step, []):
            prompt, _ = references[index]
            requests[index] = decoder.add(
                DecodeRequest(
                    prompt,
                    NEW_TOKENS,
                    stop_ids={stops[index]} if index in stops else (),
                    on_tokens=listener(index),
                )
            )
        decoder.step()
        step += 1
    for index, request in requests.items():
        expected, result = references[index][1], request.result
        if index == 1:
            assert result.finish_reason == "abort"
            assert 6 <= len(result.tokens) < NEW_TOKENS
            assert (
                result.tokens == expected[: len(result.tokens)] == streamed[1][: len(result.tokens)]
            )
        elif index in stops:
            cut = expected.index(stops[index]) + 1
            assert result.tokens == expected[:cut] and result.finish_reason == "stop"
        else:
            assert result.tokens == expected and result.finish_reason == "length"
            assert streamed[index] == expected


def test_context_end_and_budget(tiny_target, fitted, references):
    """A request whose trees stop fitting the context verifies its root alone and still decodes
    greedily to the end of the context, next to one that does not reach it."""
    prompt, expected = references[1]
    max_context = len(prompt) + 12
    decoder = BatchDecoder(
        tiny_target,
        fitted,
        spec("d6"),
        2,
        DecoderOptions(max_context=max_context, static_shapes=True, graph_batch_sizes=(1,)),
    )
    short, long = decoder.add(DecodeRequest(prompt, 5)), decoder.add(DecodeRequest(prompt, 100))
    decoder.generate_all([short, long])
    assert short.result.tokens == expected[:5]
    assert long.result.tokens == expected[:12] and long.result.finish_reason == "length"
    with pytest.raises(Eagle3Error, match="prompt has"):
        decoder.add(DecodeRequest(list(range(1, max_context + 1)), 4))


@pytest.mark.parametrize("name", ["d3", "tree"])
def test_batched_sampling_preserves_the_sequence_distribution(six_token_case, name):
    """test_engine's brute-force check with eight sampled requests per step: the first 2 tokens of
    each (36 outcomes) follow the target's exact joint distribution."""
    case, draws = six_token_case, 1000
    target, drafter, prompt = case.target, case.drafter, case.prompt
    temperature, length, exact = case.temperature, case.length, case.exact
    decoder = BatchDecoder(target, drafter, spec(name), 8, DecoderOptions(seed=1))
    requests = [
        decoder.add(DecodeRequest(prompt, length, temperature=temperature)) for _ in range(draws)
    ]
    decoder.generate_all(requests)
    counts = torch.zeros(6**length, dtype=torch.float64)
    for request in requests:
        a, b = request.result.tokens
        counts[a * 6 + b] += 1
    accepted = sum(r.result.stats.accepted_per_step[0] > 0 for r in requests)
    assert draws // 10 < accepted < draws - draws // 10  # both acceptance and rejection ran
    assert decoder.steps <= draws // 4  # eight per step (a request takes one step here)
    assert chi_square_p_value(counts, exact) > FALSE_ALARM


def test_server_batches_concurrent_requests(test_root, tiny_target):
    """engine.max_batch_size=4 behind the HTTP routes: four concurrent requests get their greedy
    decodes and share the engine's steps."""
    from fastapi.testclient import TestClient
    from support import server_cfg

    from eagle3.engine.service import service_for
    from eagle3.serve.server import create_app

    service = service_for(server_cfg(test_root, "spec=off", "engine.max_batch_size=4"))
    prompts = [service.encode_text(text) for text in PROMPTS]
    replies: dict[int, dict] = {}
    with TestClient(create_app(service)) as client:

        def send(index):
            body = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
            replies[index] = client.post(
                "/generate", json={"input_ids": prompts[index], "sampling_params": body}
            ).json()

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = client.get("/stats").json()
    for index, prompt in enumerate(prompts):
        assert replies[index]["output_ids"] == reference_greedy(tiny_target.model, prompt, 20)
    assert stats["requests"] == 4 and stats["completion_tokens"] == 80
    assert service.decoder.decoder.steps < 4 * 19  # fewer steps than one request at a time
