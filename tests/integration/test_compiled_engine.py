"""The embedded decoder with torch.compile'd parts (Inductor's CPU backend here): compiled draft and
extend phases commit what the eager ones commit, and a tree verify through the compiled layer
segments gives HF's logits, aux states and cache and the target's own greedy tokens."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import CACHE, PROMPTS, prefill_then_verify, reference_greedy, spec

from eagle3.core.common import compose
from eagle3.core.drafter import build_drafter
from eagle3.engine import DecodeRequest, SpecDecoder
from eagle3.engine.options import DecoderOptions

NEW_TOKENS = 40
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest


@pytest.fixture(scope="module")
def fitted(tiny_fitted_drafter):
    return tiny_fitted_drafter


@pytest.fixture(scope="module")
def references(tiny_target):
    prompts = [tiny_target.tokenizer(text)["input_ids"] for text in PROMPTS]
    return [(p, reference_greedy(tiny_target.model, p, NEW_TOKENS)) for p in prompts]


@pytest.mark.slow
def test_compiled_draft_phases_commit_the_same(tiny_target, fitted, references):
    """engine.compile_draft: the draft and extend phases through torch.compile (Inductor's CPU
    backend here) commit what the eager fused steps commit, step for step, for a chain and for a
    tree; crossing a cache width compiles each phase once more (generic widths), not per width."""
    from torch._dynamo.utils import counters

    long_prompt = list(range(1000, 1240))  # crosses from the 256-slot window to the 512 one
    for name, prompts, graphs in [
        ("d6", references[:2], 2),
        ("d8s4k3", [*references[:2], (long_prompt, None)], 4),
    ]:
        counters.clear()
        compiled = SpecDecoder(tiny_target, fitted, spec(name), DecoderOptions(compile_draft=True))
        eager = SpecDecoder(tiny_target, fitted, spec(name))
        for prompt, expected in prompts:
            a, b = (
                compiled.generate(DecodeRequest(prompt, 30)),
                eager.generate(DecodeRequest(prompt, 30)),
            )
            assert a.tokens == b.tokens and a.stats.accepted_per_step == b.stats.accepted_per_step
            assert expected is None or a.tokens == expected[:30]
        assert compiled.fused.width == (512 if graphs == 4 else 256)
        assert (
            counters["stats"]["unique_graphs"] == graphs
        )  # draft and extend, compiled; verify stays eager


@pytest.mark.slow
def test_compiled_layers_match_hf_and_decode_the_same(tiny_target):
    """engine.compile_layers: a tree verify through the torch.compile'd layer segments (Inductor's
    fused kernels; here its CPU backend) gives HF's logits, aux and cache, and the decoder's fused
    greedy steps with it still commit the target's own greedy tokens."""
    from torch._dynamo.utils import counters

    counters.clear()
    prefill_then_verify(tiny_target, lambda needed: CACHE, compiled=True)
    torch.manual_seed(0)
    drafter = build_drafter(tiny_target, compose(["target=tiny-llama"]).drafter).eval()
    decoder = SpecDecoder(tiny_target, drafter, spec("d8s4k3"), DecoderOptions(compile_layers=True))
    assert decoder.target_run.compile_layers and decoder.fused is not None
    for text in PROMPTS[:2]:
        prompt = tiny_target.tokenizer(text)["input_ids"]
        assert decoder.generate(DecodeRequest(prompt, 24)).tokens == reference_greedy(
            tiny_target.model, prompt, 24
        )
    # enter_layer and leave_layer, each compiled once for q = 8 (the prefill stays eager)
    assert counters["stats"]["unique_graphs"] == 2
