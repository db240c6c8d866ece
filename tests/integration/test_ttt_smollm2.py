"""The drafter for SmolLM2-135M: its parameter shapes and count, and one TTT step on the target's
real captured states."""

from __future__ import annotations

import pytest
import torch
from support import make_vocab_map

from eagle3.core.drafter import build_drafter
from eagle3.train.ttt import step_metrics, ttt_loss


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_drafter_shapes_and_a_ttt_step(make_cfg, smollm2):
    """SmolLM2-135M (H=576, 9 heads of 64, 3 KV heads, MLP 1536): the drafter's parameter shapes and
    count, and one TTT step on its real captured states."""
    cfg = make_cfg("drafter.draft_vocab_size=8192")
    drafter = build_drafter(smollm2, cfg.drafter)
    hidden, inter, kv, vocab, draft = 576, 1536, 3 * 64, 49152, 8192
    shapes = {name: tuple(p.shape) for name, p in drafter.named_parameters()}
    assert shapes == {
        "embed_tokens.weight": (vocab, hidden),
        "fc.weight": (hidden, 3 * hidden),
        "layers.0.self_attn.q_proj.weight": (hidden, 2 * hidden),
        "layers.0.self_attn.k_proj.weight": (kv, 2 * hidden),
        "layers.0.self_attn.v_proj.weight": (kv, 2 * hidden),
        "layers.0.self_attn.o_proj.weight": (hidden, hidden),
        "layers.0.mlp.gate_proj.weight": (inter, hidden),
        "layers.0.mlp.up_proj.weight": (inter, hidden),
        "layers.0.mlp.down_proj.weight": (hidden, inter),
        "layers.0.input_layernorm.weight": (hidden,),
        "layers.0.post_attention_layernorm.weight": (hidden,),
        "layers.0.hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
        "lm_head.weight": (draft, hidden),
    }
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    assert trainable == (
        3 * hidden * hidden
        + 2 * hidden * hidden
        + 2 * kv * 2 * hidden
        + hidden * hidden
        + 3 * hidden * inter
        + 4 * hidden
        + draft * hidden
    )  # 9,808,128
    assert smollm2.aux_layer_ids == [2, 15, 27]
    ids = smollm2.tokenizer(
        "The quick brown fox jumps over the lazy dog. " * 3, return_tensors="pt"
    ).input_ids
    aux, last = smollm2.capture(ids)
    lm_head = smollm2.model.get_output_embeddings().weight
    d2t, t2d = make_vocab_map((last @ lm_head.t()).argmax(-1), vocab, draft)
    drafter.set_vocab_map(d2t, t2d)
    batch = {
        "input_ids": ids,
        "loss_mask": torch.ones_like(ids),
        "aux_hidden": aux,
        "last_hidden": last,
    }
    loss, counts = ttt_loss(drafter, batch, lm_head, 7, 0.8)
    metrics = step_metrics(counts)
    assert torch.isfinite(loss) and metrics["count_0"] > 0 and 1.0 <= metrics["tau_hat"] <= 8.0
