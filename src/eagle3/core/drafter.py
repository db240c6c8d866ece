"""The EAGLE-3 drafter.

One drafting step maps (token ids, hidden state, positions) to the next hidden state:

    hidden_0 = fc(cat(aux_low, aux_mid, aux_high))          # [T, 3*H_target] -> [T, H]
    x        = cat(input_layernorm(embed(ids)), hidden_norm(hidden))   # [T, 2H]
    h        = hidden + o_proj(attention(q/k/v_proj(x)))     # q/k/v take 2H inputs
    h        = h + mlp(post_attention_layernorm(h))          # pre-norm output = next hidden
    logits   = lm_head(norm(h))                              # over the draft vocab

Attention is left to the caller through `attend(layer, q, k, v)`: training supplies the
TTT diagonal mask over earlier unroll steps, the engine a KV cache with a tree mask.
Draft token d maps to target token d + d2t[d]; t2d marks target tokens in the draft vocab.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from eagle3.core.config import DrafterConfig

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def drafter_config(target_config, dcfg: DrafterConfig, aux_layer_ids: list[int]) -> LlamaConfig:
    """A Llama config for the drafter: the target's shapes unless `drafter.*` overrides them."""

    def pick(name, target_value):
        value = getattr(dcfg, name)
        return target_value if value is None else value

    target = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    hidden = pick("hidden_size", target["hidden_size"])
    heads = pick("num_heads", target["num_attention_heads"])
    config = LlamaConfig(
        vocab_size=target["vocab_size"],
        hidden_size=hidden,
        intermediate_size=pick("intermediate_size", target["intermediate_size"]),
        num_hidden_layers=dcfg.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=pick("num_kv_heads", target.get("num_key_value_heads", heads)),
        head_dim=hidden // heads,
        hidden_act=target.get("hidden_act", "silu"),
        max_position_embeddings=pick(
            "max_position_embeddings", target.get("max_position_embeddings", 4096)
        ),
        rms_norm_eps=target.get("rms_norm_eps", 1e-6),
        rope_parameters=target.get("rope_parameters")
        or {"rope_type": "default", "rope_theta": target.get("rope_theta", 10000.0)},
        tie_word_embeddings=False,
        pad_token_id=target.get("pad_token_id"),
        bos_token_id=target.get("bos_token_id"),
        eos_token_id=target.get("eos_token_id"),
    )
    config.draft_vocab_size = dcfg.draft_vocab_size
    config.target_hidden_size = target["hidden_size"]
    config.aux_layer_ids = list(aux_layer_ids)
    return config


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Attention with grouped KV heads; mask is bool (True = attend), broadcastable to [B, h, Tq, Tk].
    With a mask the KV heads are repeated rather than passed with enable_gqa: CUDA's memory-efficient
    kernel takes a mask but not grouped heads, so enable_gqa + mask runs the float32 math kernel."""
    groups = q.shape[1] // k.shape[1]
    if mask is not None and groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


class RMSNorm(nn.Module):
    """Llama's RMSNorm (normalize in float32, cast back, scale) through F.rms_norm: one fused
    kernel on CUDA where the HF module launches five."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, in_features: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, attend: Callable) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DecoderLayer(nn.Module):
    """first=True: the EAGLE-3 layer whose attention reads cat(norm(embeds), norm(hidden))."""

    def __init__(self, config: LlamaConfig, first: bool):
        super().__init__()
        self.first = first
        hidden = config.hidden_size
        self.self_attn = Attention(config, 2 * hidden if first else hidden)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, hidden, embeds, cos, sin, attend) -> torch.Tensor:
        if self.first:
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        else:
            x = self.input_layernorm(hidden)
        hidden = hidden + self.self_attn(x, cos, sin, attend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Drafter(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden, padding_idx=config.pad_token_id)
        self.embed_tokens.weight.requires_grad_(False)  # copied from the target, frozen
        self.fc = nn.Linear(3 * config.target_hidden_size, hidden, bias=False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, first=i == 0) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Concatenated target aux states [.., 3*H_target] -> the step-0 hidden state [.., H]."""
        return self.fc(aux)

    def forward(self, input_ids, hidden, position_ids, attend: Attend) -> torch.Tensor:
        """One drafting step; returns the pre-norm hidden state (fed to the next step)."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, embeds, cos, sin, lambda q, k, v, i=index: attend(i, q, k, v))
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen target embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}


def build_drafter(target, dcfg: DrafterConfig) -> Eagle3Drafter:
    """A fresh drafter shaped for `target` (a Target or TargetParts), its embedding copied from the
    target."""
    drafter = Eagle3Drafter(drafter_config(target.config, dcfg, target.aux_layer_ids))
    drafter.embed_tokens.weight.data.copy_(target.input_embedding().data.float())
    return drafter.to(target.device)
