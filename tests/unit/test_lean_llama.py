"""The engine's lean forwards (engine/llama.py) against the modules they replace: the target's
(HF Llama: same logits, aux states and cache contents for a prefill and a tree verify, and a
fallback to HF for targets it does not cover) and the drafter's (Eagle3Drafter: same hidden
states, logits and cache for an extend and a tree draft step)."""

from __future__ import annotations

import pytest
import torch

from eagle3.core.drafter import build_drafter
from eagle3.engine.runners import DrafterRunner, TargetRunner
from eagle3.engine.tree import ancestor_mask

PROMPT_LEN = 23
CACHE = 64
PARENTS = [0, 0, 0, 1, 1, 2, 3, 6]  # an 8-node tree: root, two children, ... depth 4
EXACT = dict(atol=1e-5, rtol=1e-5)
# LeanLlama's o_proj sums the query heads in another order (layer_weights): float32 rounding
# that 30 layers grow to ~5e-5 on SmolLM2's logits
THIRTY_LAYERS = dict(atol=1e-4, rtol=1e-5)
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest


def runners(target):
    lean, hf = TargetRunner(target, CACHE), TargetRunner(target, CACHE, lean=False)
    assert lean.lean is not None and hf.lean is None
    return lean, hf


def assert_same(lean, hf, *inputs, compiled: bool = False, tolerance=EXACT) -> None:
    with torch.inference_mode():
        ours = lean._forward(*inputs, compiled=True) if compiled else lean.forward(*inputs)
        (logits, aux), (ref_logits, ref_aux) = ours, hf.forward(*inputs)
    assert logits.dtype == torch.float32 and aux.shape == ref_aux.shape
    torch.testing.assert_close(logits, ref_logits, **tolerance)
    torch.testing.assert_close(aux, ref_aux, **tolerance)
    torch.testing.assert_close(lean.kv.buffer, hf.kv.buffer, **tolerance)


def prefill_then_verify(target, kv_len, compiled: bool = False, tolerance=EXACT) -> None:
    """A causal prefill of a random prompt, then one verify of an 8-node tree after it (per-node
    positions, ancestor mask), attention reading `kv_len(needed)` cache slots; compiled: the
    verify runs the layers torch.compile'd, as a fixed-shape verify does with compile_layers."""
    lean, hf = runners(target)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (PROMPT_LEN,), generator=generator)
    positions = torch.arange(PROMPT_LEN)
    causal = torch.arange(kv_len(PROMPT_LEN))[None, :] <= positions[:, None]
    assert_same(lean, hf, ids, positions, positions, causal, tolerance=tolerance)
    parents = torch.tensor(PARENTS)
    q = parents.numel()
    depths = torch.zeros(q, dtype=torch.long)
    for node in range(1, q):
        depths[node] = depths[parents[node]] + 1
    tree = torch.zeros(q, kv_len(PROMPT_LEN + q), dtype=torch.bool)
    tree[:, :PROMPT_LEN] = True
    tree[:, PROMPT_LEN : PROMPT_LEN + q] = ancestor_mask(parents, int(depths.max()))
    tokens = torch.randint(0, target.vocab_size, (q,), generator=generator)
    assert_same(
        lean,
        hf,
        tokens,
        PROMPT_LEN + depths,
        torch.arange(PROMPT_LEN, PROMPT_LEN + q),
        tree,
        compiled=compiled,
        tolerance=tolerance,
    )


@pytest.mark.parametrize("width", ["needed", "whole cache"])
def test_tiny_llama_matches_hf(tiny_target, width):
    """Grouped KV heads (the tiny Llama has 4 query heads on 2 KV heads); 'whole cache' is how a
    CUDA graph runs it: attention over every slot, the unused ones masked."""
    config = tiny_target.config
    assert config.num_attention_heads > config.num_key_value_heads > 1
    prefill_then_verify(
        tiny_target, (lambda needed: needed) if width == "needed" else (lambda needed: CACHE)
    )


@pytest.mark.slow
def test_smollm2_matches_hf(smollm2):
    assert next(smollm2.model.parameters()).dtype == torch.float32
    prefill_then_verify(smollm2, lambda needed: needed, tolerance=THIRTY_LAYERS)


@pytest.mark.slow
def test_compiled_layers_match_hf_and_decode_the_same(tiny_target):
    """engine.compile_layers: a tree verify through the torch.compile'd layer segments (Inductor's
    fused kernels; here its CPU backend) gives HF's logits, aux and cache, and the decoder's fused
    greedy steps with it still commit the target's own greedy tokens."""
    from engine_helpers import PROMPTS, reference_greedy, spec
    from torch._dynamo.utils import counters

    from eagle3.core.common import compose
    from eagle3.engine import DecodeRequest, SpecDecoder

    counters.clear()
    prefill_then_verify(tiny_target, lambda needed: CACHE, compiled=True)
    torch.manual_seed(0)
    drafter = build_drafter(tiny_target, compose(["target=tiny-llama"]).drafter).eval()
    decoder = SpecDecoder(tiny_target, drafter, spec("d8s4k3"), compile_layers=True)
    assert decoder.target_run.compile_layers and decoder.fused is not None
    for text in PROMPTS[:2]:
        prompt = tiny_target.tokenizer(text)["input_ids"]
        assert decoder.generate(DecodeRequest(prompt, 24)).tokens == reference_greedy(
            tiny_target.model, prompt, 24
        )
    # enter_layer and leave_layer, each compiled once for q = 8 (the prefill stays eager)
    assert counters["stats"]["unique_graphs"] == 2


def test_other_models_fall_back_to_hf(tiny_target):
    """A Llama with attention biases is not what LeanLlama computes: the runner keeps HF's forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3.core.target import Target

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        attention_bias=True,
    )
    target = Target(LlamaForCausalLM(config).eval(), None, None, [0, 1, 1])
    assert TargetRunner(target, CACHE).lean is None
    assert TargetRunner(tiny_target, CACHE).lean is not None


def test_drafter_matches_the_module(tiny_target, make_cfg):
    """An extend of the prompt's aux states, then a draft step of 3 frontier rows that each see the
    prefix and their own slot: hidden states, logits and the cache equal the module's path."""
    torch.manual_seed(0)
    drafter = build_drafter(tiny_target, make_cfg("target=tiny-llama").drafter).eval()
    for name, weight in drafter.named_parameters():
        if name.endswith("norm.weight"):  # ones at init: tell the norms apart
            weight.data.normal_(1.0, 0.3)
    lean, module = DrafterRunner(drafter, CACHE), DrafterRunner(drafter, CACHE, lean=False)
    assert lean.lean is not None and module.lean is None
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tiny_target.vocab_size, (PROMPT_LEN,), generator=generator)
    aux, _ = tiny_target.capture(ids[None])
    positions = torch.arange(PROMPT_LEN)
    causal = torch.arange(CACHE)[None, :] <= positions[:, None]
    rows = torch.arange(3)
    slots = PROMPT_LEN + rows
    frontier = (torch.arange(CACHE)[None, :] < PROMPT_LEN) | (
        torch.arange(CACHE)[None, :] == slots[:, None]
    )
    with torch.inference_mode():
        for kind, inputs in (
            ("extend", (ids, aux[0], positions, positions, causal)),
            (
                "step",
                (
                    ids[:3],
                    torch.randn(3, drafter.config.hidden_size, generator=generator),
                    PROMPT_LEN + 0 * rows,
                    slots,
                    frontier,
                ),
            ),
        ):
            (hidden, logits), (ref_hidden, ref_logits) = (
                lean._run(kind, *inputs),
                module._run(kind, *inputs),
            )
            torch.testing.assert_close(hidden, ref_hidden, **EXACT)
            torch.testing.assert_close(logits, ref_logits, **EXACT)
            torch.testing.assert_close(lean.kv.buffer, module.kv.buffer, **EXACT)
            torch.testing.assert_close(lean.logits(hidden), ref_logits, **EXACT)


def test_heads_split_and_merge_without_copies():
    """The layouts the GPU verify's saving rests on (H200, 32-node verify: 60 copy kernels fewer):
    split_heads' queries are a view of rotary's output, token-major [q, groups, kv_heads, dim], i.e.
    the strides attention gives its output for them, and merge_heads of such an output is a view."""
    from eagle3.engine.llama import LeanBlocks

    heads, kv_heads, dim, q = 6, 2, 8, 5
    blocks = LeanBlocks(heads, kv_heads, dim, 1e-6, torch.float32)
    qkv = torch.randn(q, (heads + 2 * kv_heads) * dim)
    queries, keys, values = blocks.split_heads(qkv, torch.randn(q, dim), torch.randn(q, dim))
    groups = heads // kv_heads
    assert queries.shape == (1, kv_heads, q * groups, dim) and keys.shape == values.shape == (
        1,
        kv_heads,
        q,
        dim,
    )
    assert queries._base is not None and queries.stride()[1:] == (dim, kv_heads * dim, 1)
    out = torch.randn(1, q * groups, kv_heads, dim).transpose(1, 2)  # token-major, like the queries
    merged = blocks.merge_heads(out)
    assert (
        merged.shape == (q, heads * dim)
        and merged.data_ptr() == out.data_ptr()
        and merged._base is not None
    )
