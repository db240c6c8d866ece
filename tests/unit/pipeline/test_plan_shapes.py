"""Target sizes from a config alone, against brute-force counts of the models transformers builds."""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from eagle3.core.common import compose
from eagle3.pipeline.plan_shapes import (
    active_params,
    checkpoint_bytes,
    kv_bytes_per_token,
    param_counts,
)


def counted(model: torch.nn.Module) -> int:
    """Parameters without norms and the router's correction bias (param_counts leaves them out)."""
    return sum(
        p.numel()
        for name, p in model.named_parameters()
        if "norm" not in name and "e_score_correction_bias" not in name
    )


def test_param_counts_equal_the_built_models():
    moe = {
        **dict(compose(["target=moe-rehearsal"]).target.architecture),
        "vocab_size": 49152,
        "tie_word_embeddings": False,
    }
    with torch.device("meta"):
        deepseek = DeepseekV3ForCausalLM(DeepseekV3Config(**moe))
        llama = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=500,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=3,
                num_attention_heads=8,
                num_key_value_heads=2,
                tie_word_embeddings=True,
            )
        )
    assert sum(param_counts(moe).values()) == counted(deepseek)
    llama_config = llama.config.to_dict()
    assert sum(param_counts(llama_config).values()) == counted(llama)
    experts = param_counts(moe)["routed_experts"]
    assert experts == 11 * 64 * 3 * 1536 * 384  # 11 MoE layers after 1 dense
    assert active_params(moe) == sum(param_counts(moe).values()) - 49152 * 1536 - experts * 56 // 64


def test_kimi_k25_weights_and_kv_at_their_stored_dtypes():
    kimi = compose(["experiment=kimi-k2.5"]).target.plan
    config = dict(kimi["config"])
    # 1,026.4 B text parameters; 32.86 B active with the embedding, as published
    assert round(sum(param_counts(config).values()) / 1e9, 1) == 1026.4
    assert round((active_params(config) + param_counts(config)["embedding"]) / 1e9, 2) == 32.86
    stored = checkpoint_bytes(config, dict(kimi["storage"]))
    bf16 = checkpoint_bytes(config, {"bytes": 2})
    assert round(stored / 1e9, 1) == 594.2 and round(bf16 / 1e9, 1) == 2052.8
    assert kv_bytes_per_token(config, 2) == (61 * (512 + 64) * 2, True)
