"""The embedded engine on SmolLM2-135M (float32): its lean forward gives HF's logits, aux states and
cache for a prefill and a tree verify, and speculative greedy decoding with an untrained and with a
trained drafter is the target's own greedy decode."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    agree_cfg,
    agree_prompts,
    prefill_then_verify,
    reference_greedy,
    spec,
)

from eagle3.core.common import compose
from eagle3.core.drafter import build_drafter
from eagle3.engine import DecodeRequest, SpecDecoder, summarize
from eagle3.engine.service import drafter_source_for, load_engine_drafter

# LeanLlama's o_proj sums the query heads in another order (layer_weights): float32 rounding
# that 30 layers grow to ~5e-5 on SmolLM2's logits
THIRTY_LAYERS = dict(atol=1e-4, rtol=1e-5)
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest


@pytest.mark.slow
def test_smollm2_matches_hf(smollm2):
    assert next(smollm2.model.parameters()).dtype == torch.float32
    prefill_then_verify(smollm2, lambda needed: needed, tolerance=THIRTY_LAYERS)


@pytest.fixture(scope="module")
def smollm2_greedy(smollm2):
    """SmolLM2's own greedy continuation of a prompt (24 tokens by reference_greedy: generate's
    min_new_tokens would mask EOS), computed once per prompt for all the specs below."""
    computed: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in computed:
            computed[tuple(prompt)] = reference_greedy(smollm2.model, prompt, 24)
        return computed[tuple(prompt)]

    return greedy


@pytest.mark.slow
@pytest.mark.parametrize("name", ["d4", "d6s3k2"])
def test_smollm2_greedy_is_lossless_untrained_drafter(smollm2, smollm2_greedy, name):
    torch.manual_seed(0)
    drafter = build_drafter(smollm2, compose(["target=smollm2-135m"]).drafter).eval()
    decoder = SpecDecoder(smollm2, drafter, spec(name))
    tok = smollm2.tokenizer
    for question in ["What is the capital of France?", "Write a haiku about the sea."]:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        assert decoder.generate(DecodeRequest(prompt, 24)).tokens == smollm2_greedy(prompt)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["d4", "d6s3k2"])
def test_smollm2_greedy_is_lossless_trained_drafter(
    smollm2, smollm2_trained_drafter, smollm2_greedy, test_root, name
):
    """The drafter eagle3.train made (engine_helpers.trained_smollm2_drafter), loaded as the server
    loads it: drafts are accepted (measured tau > 1.2) and the output is still the target's greedy decode."""
    cfg = agree_cfg(test_root, f"drafter.path={smollm2_trained_drafter}")
    drafter, _ = load_engine_drafter(drafter_source_for(cfg), smollm2, spec(name))
    decoder = SpecDecoder(smollm2, drafter, spec(name))
    stats = []
    for prompt in agree_prompts(smollm2, cfg)[:3]:
        result = decoder.generate(DecodeRequest(prompt, 24))
        assert result.tokens == smollm2_greedy(prompt)
        stats.append(result.stats)
    assert summarize(stats)["tau"] > 1.2
