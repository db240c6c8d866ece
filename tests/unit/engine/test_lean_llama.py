"""The engine's lean forwards (engine/llama.py) against the modules they replace: the target's
(HF Llama: same logits, aux states and cache contents for a prefill and a tree verify, and a
fallback to HF for targets it does not cover) and the drafter's (Eagle3Drafter: same hidden
states, logits and cache for an extend and a tree draft step)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import CACHE, EXACT, PROMPT_LEN, prefill_then_verify

from eagle3.core.drafter import build_drafter
from eagle3.engine.runners import DrafterRunner, TargetRunner


@pytest.mark.parametrize("width", ["needed", "whole cache"])
def test_tiny_llama_matches_hf(tiny_target, width):
    """Grouped KV heads (the tiny Llama has 4 query heads on 2 KV heads); 'whole cache' is how a
    CUDA graph runs it: attention over every slot, the unused ones masked."""
    config = tiny_target.config
    assert config.num_attention_heads > config.num_key_value_heads > 1
    prefill_then_verify(
        tiny_target, (lambda needed: needed) if width == "needed" else (lambda needed: CACHE)
    )


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
