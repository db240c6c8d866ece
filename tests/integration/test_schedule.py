"""The batched engine as served: the shape of each step from the load sweep's schedule (greedy output
unchanged as the live batch crosses the schedule's thresholds up and down; run only when named and
only where measured), batching by default with the batch-1 decoder for a lone request, and the
deterministic mode (outputs independent of the batch size and the shape)."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch
from engine_helpers import PROMPTS, reference_greedy, spec
from support import load_job, server_cfg
from support import load_results as results

from eagle3.bench.concurrency import write_load_summary, write_schedule
from eagle3.core.common import Eagle3Error, hardware, local_engine_version
from eagle3.core.spec import OFF, Spec
from eagle3.engine import DecodeRequest
from eagle3.engine.batch_decoder import BatchDecoder
from eagle3.engine.options import DecoderOptions
from eagle3.engine.schedule import Schedule, read_schedule, resolve_schedule_path
from eagle3.engine.service import Generation, service_for
from eagle3.serve.app import shapes

NEW_TOKENS = 32
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest


@pytest.fixture(scope="module")
def references(tiny_target):
    texts = [*PROMPTS, PROMPTS[0] + " " + PROMPTS[2]]
    prompts = [tiny_target.tokenizer(text)["input_ids"] for text in texts]
    return [(p, reference_greedy(tiny_target.model, p, NEW_TOKENS)) for p in prompts]


def test_the_engine_reads_the_schedule_the_load_sweep_wrote(tmp_path):
    """eagle3.bench.concurrency writes schedule.json beside the drafter's export; engine.schedule=auto finds it
    from the drafter folder and runs d32s4k8 below 16 rows and spec=off from 16 rows on."""
    export = tmp_path / "export" / "abc123"
    (export / "sglang").mkdir(parents=True)
    jobs = results()
    for job in jobs:
        if job["drafter"]:
            job["drafter"] = str(export / "sglang")
    write_load_summary(jobs, tmp_path)
    path = resolve_schedule_path("auto", str(export / "sglang"))
    assert path == export / "schedule.json"
    schedule = read_schedule(path)
    d32 = Spec(enabled=True, depth=32, steps=4, topk=8)
    assert [schedule.shape_for(b) for b in (1, 2, 15, 16, 64)] == [d32, d32, d32, OFF, OFF]
    assert resolve_schedule_path("off", str(export / "sglang")) is None
    with pytest.raises(
        Eagle3Error, match="engine.schedule=auto: no schedule.json beside the drafter"
    ):
        resolve_schedule_path("auto", str(tmp_path / "elsewhere" / "sglang"))
    with pytest.raises(Eagle3Error, match="spec=auto: no schedule.json beside the drafter"):
        resolve_schedule_path("off", str(tmp_path / "elsewhere" / "sglang"), auto=True)
    assert resolve_schedule_path("off", str(export / "sglang"), auto=True) == path
    with pytest.raises(Eagle3Error, match="engine.schedule=.*no such file"):
        resolve_schedule_path(str(tmp_path / "missing.json"), None)
    sglang_only = tmp_path / "sglang.json"
    plan = json.loads(path.read_text())
    sglang_only.write_text(json.dumps([{**plan[0], "engine": "sglang"}]))
    with pytest.raises(Eagle3Error, match="no entries measured on serve=local"):
        read_schedule(sglang_only)


def off_schedule_beside(tiny_drafter, tmp_path, machine: str) -> Path:
    """A copy of the tiny drafter's export with the schedule a load sweep writes beside it when
    nothing beat spec=off at batch 1 ("1+: off"), measured on `machine` with this engine."""
    export = tmp_path / "export" / "abc123"
    shutil.copytree(tiny_drafter, export)
    jobs = [
        load_job("off", 1, 0, 1, 1, 100.0, 100.0, 0.010, 0.010),
        load_job("d8", 8, 7, 1, 1, 60.0, 100.0, 0.020, 0.010, 0.05),
    ]
    for job in jobs:
        job.update(hardware=machine, engine_version=local_engine_version())
        job["drafter"] = str(export / "sglang") if job["drafter"] else None
    write_schedule(jobs, tmp_path)
    assert read_schedule(export / "schedule.json").describe() == "1+: off"
    return export


def one_reply(service) -> dict:
    request = Generation(service.encode_text(PROMPTS[0]), 8, 0.0, ignore_eos=True)
    service.generate(request)
    return service.stats()


def test_a_schedule_runs_only_when_named_and_where_it_was_measured(
    test_root, make_cfg, tiny_drafter, tmp_path
):
    """A "1+: off" schedule beside the drafter: spec.depth=8 drafts all the same (the spec given is
    the spec that runs); spec=auto runs the schedule (spec=off at batch 1: no drafts); a schedule
    measured on other hardware is refused in one line naming both machines."""
    export = off_schedule_beside(tiny_drafter, tmp_path, hardware())
    drafter = f"drafter.path={export / 'sglang'}"
    given = one_reply(service_for(server_cfg(test_root, drafter, "spec.depth=8")))
    assert given["spec"] == "d8" and given["schedule"] is None
    assert given["num_draft_tokens"] == 7 * given["num_drafts"] > 0
    auto = one_reply(service_for(server_cfg(test_root, drafter, "spec=auto")))
    assert auto["schedule"] == "1+: off" and auto["num_draft_tokens"] == 0
    named = f"engine.schedule={export / 'schedule.json'}"
    assert one_reply(service_for(server_cfg(test_root, drafter, named)))["schedule"] == "1+: off"
    # what the serve app says at start, before it starts the engine
    auto_cfg = server_cfg(test_root, drafter, "spec=auto")
    said = shapes(
        auto_cfg.serve,
        auto_cfg.engine,
        auto_cfg.spec.schedule,
        Spec(True, 8, 7, 1),
        export / "sglang",
    )
    assert said == f"shape per batch size (schedule {export / 'schedule.json'}): 1+: off"
    elsewhere = off_schedule_beside(tiny_drafter, tmp_path / "h200", "8x NVIDIA H200")
    refused = f"{elsewhere / 'schedule.json'}: measured on 8x NVIDIA H200, this machine runs "
    refused += f"{hardware()}: a schedule runs only where it was measured; rerun the load sweep "
    refused += "here or serve one shape (spec.*)"
    auto_elsewhere = server_cfg(test_root, f"drafter.path={elsewhere / 'sglang'}", "spec=auto")
    with pytest.raises(Eagle3Error) as by_engine:
        service_for(auto_elsewhere)
    with pytest.raises(Eagle3Error) as by_serve:
        shapes(
            auto_elsewhere.serve,
            auto_elsewhere.engine,
            auto_elsewhere.spec.schedule,
            Spec(True, 8, 7, 1),
            elsewhere / "sglang",
        )
    assert str(by_engine.value) == str(by_serve.value) == refused
    with pytest.raises(Eagle3Error, match="spec=auto runs a load sweep's schedule on serve=local"):
        vllm = make_cfg("serve=vllm", "spec=auto")
        shapes(vllm.serve, vllm.engine, vllm.spec.schedule, Spec(True, 8, 7, 1), None)


@pytest.mark.slow
def test_serve_with_a_spec_drafts_beside_a_schedule_that_says_off(
    test_root, tiny_drafter, tmp_path
):
    """`python -m eagle3.serve spec.depth=8` with a load sweep's "1+: off" schedule.json beside the
    drafter says at start that d8 runs at every batch size, and drafts (its /stats count draft
    tokens)."""
    export = off_schedule_beside(tiny_drafter, tmp_path, hardware())
    argv = [
        sys.executable,
        "-m",
        "eagle3.serve",
        f"paths.root={tmp_path}",
        f"paths.artifacts={test_root / 'artifacts'}",
        "tracking.enabled=false",
        "target=tiny-llama",
        "engine.cpu_threads=1",
        "engine.max_context=64",
        "serve.port=0",
        f"drafter.path={export / 'sglang'}",
        "spec.depth=8",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said = []
        for line in proc.stdout:
            said.append(line)
            if "serving" in line:
                break
        assert "shape per batch size: d8 at every batch size\n" in said, "".join(said[-20:])
        url = re.search(r"at (http://\S+);", said[-1]).group(1)
        httpx.post(
            url + "/generate",
            json={
                "text": PROMPTS[0],
                "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            },
            timeout=120,
        ).raise_for_status()
        stats = httpx.get(url + "/stats", timeout=30).json()
        assert stats["spec"] == "d8" and stats["schedule"] is None
        assert stats["num_draft_tokens"] == 7 * stats["num_drafts"] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("static", [False, True])
def test_shapes_follow_the_schedule_and_lose_nothing(
    tiny_target, tiny_fitted_drafter, references, static
):
    """Arrivals at steps 0, 3 and 6 (two), budgets that end requests at different steps: the live
    batch goes 1 -> 2 -> 4 -> 3 -> 2 -> 1, so the shape goes tree -> chain -> off and back. Every
    step runs the shape the schedule names for its rows, and every output is the target's greedy
    decode. static: at the padded shapes CUDA graphs replay."""
    schedule = Schedule(((1, spec("d8s4k3")), (2, spec("d6")), (3, OFF)), "test")
    decoder = BatchDecoder(
        tiny_target,
        tiny_fitted_drafter,
        spec("d6"),
        4,
        DecoderOptions(graph_batch_sizes=(2,), static_shapes=static),
        schedule=schedule,
    )
    arrivals = {0: [0], 3: [1], 6: [2, 3]}
    budgets = [NEW_TOKENS, 26, 10, 18]
    requests, ran = {}, []
    step = 0
    while step <= max(arrivals) or decoder.busy:
        for index in arrivals.get(step, []):
            requests[index] = decoder.add(DecodeRequest(references[index][0], budgets[index]))
        rows_before, shapes_before = Counter(decoder.rows_per_step), Counter(decoder.shape_steps)
        decoder.step()
        rows = list((decoder.rows_per_step - rows_before).elements())
        shapes = list((decoder.shape_steps - shapes_before).elements())
        if rows:
            ran.append((rows[0], shapes[0]))
        step += 1
    for index, request in requests.items():
        assert request.result.tokens == references[index][1][: budgets[index]]
    assert all(schedule.shape_for(rows).label == label for rows, label in ran)
    labels = [label for _, label in ran]
    order = {"d8s4k3": 0, "d6": 1, "off": 2}
    moves = {(order[a] > order[b]) - (order[a] < order[b]) for a, b in zip(labels, labels[1:])}
    assert moves >= {-1, 1}  # the shape went up and came back down
    assert set(labels) == {"d8s4k3", "d6", "off"}
    assert sum(decoder.shape_steps.values()) == decoder.steps == len(ran)


def test_serve_batches_four_requests_by_default(test_root, tiny_target):
    """engine.max_batch_size=auto (the CPU's entry): a request alone runs on the batch-1 decoder;
    when three more arrive it joins them and the four share steps; all four get their greedy
    decodes, and the counters count each request's verified drafts."""
    cfg = server_cfg(test_root)
    service = service_for(cfg)
    scheduler = service.decoder
    assert scheduler.decoder.max_batch_size == cfg.engine.auto_batch_size["cpu"]
    prompts = [service.encode_text(text) for text in PROMPTS]
    replies: dict[int, list[int]] = {}
    others_queued = threading.Event()

    def first_text(_delta: str) -> None:  # hold the lone request until the others are queued
        others_queued.wait(timeout=60)

    def send(index: int, on_text=None) -> None:
        request = Generation(prompts[index], NEW_TOKENS, 0.0, ignore_eos=True)
        replies[index] = service.generate(request, on_text).tokens

    lone = threading.Thread(target=send, args=(0, first_text))
    lone.start()
    while scheduler.alone == 0:
        threading.Event().wait(0.01)
    others = [threading.Thread(target=send, args=(i,)) for i in (1, 2, 3)]
    for thread in others:
        thread.start()
    while len(scheduler.decoder.waiting) < 3:
        threading.Event().wait(0.01)
    others_queued.set()
    for thread in [lone, *others]:
        thread.join()
    for index, prompt in enumerate(prompts):
        assert replies[index] == reference_greedy(tiny_target.model, prompt, NEW_TOKENS)
    stats = service.stats()
    assert stats["alone_requests"] == 1 and stats["handed_over_requests"] == 1
    assert stats["steps_per_batch_size"].get("4", 0) > 0
    assert stats["completion_tokens"] == 4 * NEW_TOKENS
    assert stats["num_draft_tokens"] == (cfg.spec.depth - 1) * stats["num_drafts"]


def near_tie_target(target, rel: float):
    """tiny-llama with three lm_head rows copied from the rows of its three most frequent greedy
    tokens, scaled by 1 + rel: wherever one of those tokens wins, its copy's logit is within rel of
    it (the near-ties a bf16 SmolLM2 shows, at float32 scale)."""
    prompts = [target.tokenizer(text)["input_ids"] for text in PROMPTS]
    counts = Counter(t for p in prompts for t in reference_greedy(target.model, p, 24))
    model = copy.deepcopy(target.model)
    with torch.no_grad():
        head = model.lm_head.weight
        for token, _ in counts.most_common(3):
            head[(token + 1000) % head.shape[0]] = head[token] * (1 + rel)
    return dataclasses.replace(target, model=model)


@pytest.mark.parametrize(
    "dtype, rel",
    [("float32", 1e-7), pytest.param("bfloat16", 4e-3, marks=pytest.mark.slow)],
)
def test_deterministic_outputs_do_not_depend_on_batch_or_shape(
    test_root, tiny_target, tiny_fitted_drafter, dtype, rel
):
    """engine.deterministic on a target full of near-ties (logits rel apart, below the summation
    order noise of the weights' dtype): 16 prompts give the same outputs at batch 1, 4 and 16 with
    spec=off, a chain and a tree (12 tokens each). Without the mode, on a 2-core x86 CPU, 2 to 4 of the 16 outputs
    change with the batch size or the shape in float32 and in bf16."""
    from eagle3.core.common import compose
    from eagle3.core.target import load_target

    if dtype != "float32":
        cfg = compose([f"paths.root={test_root}", "target=tiny-llama", f"target.dtype={dtype}"])
        tiny_target = load_target(cfg.target, cfg.paths.artifacts)
    target = near_tie_target(tiny_target, rel)
    drafter = copy.deepcopy(tiny_fitted_drafter).to(target.model.dtype)
    texts = [a + " " + b for a in PROMPTS for b in PROMPTS]
    prompts = [target.tokenizer(text)["input_ids"] for text in texts]
    outputs = {}
    for name in ("off", "d6", "d8s4k3"):
        for batch in (1, 4, 16):
            decoder = BatchDecoder(
                target, drafter, spec(name), batch, DecoderOptions(deterministic=True)
            )
            requests = [decoder.add(DecodeRequest(p, 12)) for p in prompts]
            outputs[name, batch] = [r.tokens for r in decoder.generate_all(requests)]
            assert max(decoder.rows_per_step) == batch
    first = outputs["off", 1]
    assert all(out == first for out in outputs.values()), [
        key for key, out in outputs.items() if out != first
    ]
