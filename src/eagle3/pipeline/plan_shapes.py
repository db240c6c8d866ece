"""Sizes of a target from its config alone (config.json's text config, or target.plan.config for a
target planned without downloading it): parameters by part, the checkpoint's bytes at the dtypes it
is stored in, parameters used per token, and KV-cache bytes per token. Llama-style and DeepSeek-V3
family (MLA attention, routed + shared experts after first_k_dense_replace dense layers) configs.
"""

from __future__ import annotations


def attention_params(c: dict) -> int:
    """One layer's attention projections (MLA's low-rank q and kv paths, or q/k/v/o)."""
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    if c.get("kv_lora_rank") is not None:
        qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        q_rank = c.get("q_lora_rank")
        q = hidden * heads * qk_head if not q_rank else hidden * q_rank + q_rank * heads * qk_head
        kv_rank = c["kv_lora_rank"]
        kv = hidden * (kv_rank + c["qk_rope_head_dim"])
        kv += kv_rank * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
        return q + kv + heads * c["v_head_dim"] * hidden
    head_dim = c.get("head_dim") or hidden // heads
    kv_heads = c.get("num_key_value_heads") or heads
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim


def param_counts(c: dict) -> dict[str, int]:
    """Parameters by part (norms and biases left out: they are < 0.01 % of any target here)."""
    hidden, layers = c["hidden_size"], c["num_hidden_layers"]
    experts = c.get("n_routed_experts") or 0
    dense_layers = min(c.get("first_k_dense_replace", layers), layers) if experts else layers
    moe_layers = layers - dense_layers
    expert = 3 * hidden * (c.get("moe_intermediate_size") or 0)
    vocab_rows = c["vocab_size"] * hidden
    return {
        "embedding": vocab_rows,
        "head": 0 if c.get("tie_word_embeddings") else vocab_rows,
        "attention": layers * attention_params(c),
        "dense_mlp": dense_layers * 3 * hidden * c["intermediate_size"],
        "routed_experts": moe_layers * experts * expert,
        "shared_experts": moe_layers * (c.get("n_shared_experts") or 0) * expert,
        "router": moe_layers * experts * hidden,
    }


def active_params(c: dict) -> int:
    """Parameters one token's forward multiplies by (the embedding is a lookup): the compute proxy
    the plan scales measured rates with."""
    counts = param_counts(c)
    head = counts["head"] or counts["embedding"]
    routed = counts["routed_experts"]
    if routed:
        routed = routed * c["num_experts_per_tok"] // c["n_routed_experts"]
    rest = counts["attention"] + counts["dense_mlp"] + counts["shared_experts"] + counts["router"]
    return head + routed + rest


def checkpoint_bytes(c: dict, storage: dict) -> float:
    """Bytes of the weights as stored: `storage.bytes` per parameter, routed experts at
    `storage.expert_bits` with one `storage.scale_bytes` scale per `storage.group_size` weights
    when the checkpoint quantizes them (Kimi-K2.5: int4, group 32, bf16 scales)."""
    counts = param_counts(c)
    routed = counts.pop("routed_experts")
    per_expert_weight = float(storage["bytes"])
    if storage.get("expert_bits"):
        per_expert_weight = (
            storage["expert_bits"] / 8 + storage["scale_bytes"] / storage["group_size"]
        )
    return sum(counts.values()) * float(storage["bytes"]) + routed * per_expert_weight


def kv_bytes_per_token(c: dict, itemsize: int) -> tuple[int, bool]:
    """(KV-cache bytes one token takes over all layers, whether it is MLA's latent). MLA caches the
    kv latent and the rope key once per token, shared by every head: tensor parallelism does not
    split it (each rank holds all of it); K/V heads are split over the ranks."""
    layers = c["num_hidden_layers"]
    if c.get("kv_lora_rank") is not None:
        return layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * itemsize, True
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return layers * 2 * (c.get("num_key_value_heads") or heads) * head_dim * itemsize, False
