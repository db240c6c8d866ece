"""Lean forwards for the engine: an HF Llama target's (verify and prefill: the same logits, aux
states and cache writes as LlamaModel + lm_head + aux_capture) and the drafter's step (the same
hidden states, logits and cache writes as Eagle3Drafter), in fewer kernels per layer.

A replayed verify of a small target is bound by kernel count, not bandwidth; HF's eager
Llama launches ~44 kernels a layer. Per layer here: residual add, RMSNorm (2), one qkv GEMM,
rotary on q and on k (4 each), K/V stacked (1) and written (1), attention (1-2), o_proj,
residual add; RMSNorm (2), one gate_up GEMM, silu, *up, down (SmolLM2 shapes, bf16, H200: 643
kernels per verify forward against HF's 1,316). With compile_layers the segments around the
cache write and attention go through torch.compile, which fuses the adds, norms, rotary and
silu * up (H200, q=1 verify: 1.73 -> 1.28 ms). The query heads are laid out so that neither
attention's input nor its output needs a copy at any query length (split_heads, merge_heads:
H200, a 32-node verify, 526 -> 466 kernels, 1.45 -> 1.35 ms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from eagle3.core.common import Eagle3Error
from eagle3.core.target import Target
from eagle3.engine.kv import SlotKV


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # cat of q/k/v_proj weights (a copy, query heads reordered)
    o: torch.Tensor  # o_proj's weight, its columns reordered the same way (a copy)
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # cat of gate/up_proj weights (a copy)
    down: torch.Tensor


class LeanBlocks:
    """The pieces both lean forwards share: RMSNorm, the heads' split (rotary) and merge, the mask bias."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, eps: float, dtype: torch.dtype):
        self.heads, self.kv_heads, self.head_dim, self.eps, self.dtype = (
            heads,
            kv_heads,
            head_dim,
            eps,
            dtype,
        )

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # rms_norm accumulates in float32 and returns x's dtype; the weight multiplies after that
        # cast, as in HF's LlamaRMSNorm
        return weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)

    def split_heads(self, qkv: torch.Tensor, cos, sin):
        """qkv [q, (heads + 2 kv_heads) * dim], query heads in layer_weights' group-major order
        -> rotated queries [1, kv_heads, q * groups, dim], rotated keys and values [1, kv_heads, q, dim].
        GQA without repeating K/V: the query heads sharing a KV head fold into the query length,
        token-major (row t * groups + g). The queries are then a view of rotary's output laid out
        [q, groups, kv_heads, dim], as attention writes its output; neither side needs a copy."""
        q_len, heads, kv_heads, dim = qkv.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = qkv.view(q_len, heads + 2 * kv_heads, dim)
        cos, sin = cos[:, None], sin[:, None]
        queries = rotate(qkv[:, :heads], cos, sin).view(-1, kv_heads, dim).transpose(0, 1)[None]
        keys = rotate(qkv[:, heads : heads + kv_heads], cos, sin).transpose(0, 1)[None]
        return queries, keys, qkv[:, heads + kv_heads :].transpose(0, 1)[None]

    def merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's [1, kv_heads, q * groups, dim] (split_heads' layout) -> [q, heads * dim] in the
        group-major head order that layer_weights gives o_proj's columns (a view when attention
        wrote its output token-major, as the GPU kernels do)."""
        return out[0].transpose(0, 1).reshape(-1, self.heads * self.head_dim)

    def attention_bias(self, mask: torch.Tensor) -> torch.Tensor:
        """Bool [q, kv_len] -> additive [q * groups, kv_len] in the model's dtype, once per forward
        (sdpa would convert a bool mask again in every layer)."""
        bias = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device)
        bias = bias.masked_fill(~mask, torch.finfo(self.dtype).min)
        return bias.repeat_interleave(self.heads // self.kv_heads, dim=0)


class LeanLlama(LeanBlocks):
    """Built once from a Target's LlamaForCausalLM; the fused qkv and gate_up weights duplicate
    the target's (fine for the targets served here), every other weight is shared."""

    @staticmethod
    def supports(model) -> bool:
        """A plain Llama: no biases, silu, and rotary frequencies that do not change with the
        positions seen (HF recomputes them in the forward for dynamic and longrope)."""
        config = model.config
        rope_type = (
            model.model.rotary_emb.rope_type if isinstance(model, LlamaForCausalLM) else None
        )
        return (
            config.model_type == "llama"
            and rope_type is not None
            and "dynamic" not in rope_type
            and rope_type != "longrope"
            and not config.attention_bias
            and not config.mlp_bias
            and config.hidden_act == "silu"
            and getattr(config, "pretraining_tp", 1) == 1
        )

    @torch.no_grad()
    def __init__(self, target: Target, max_len: int):
        model, config = target.model, target.config
        if max(target.aux_layer_ids) >= config.num_hidden_layers or min(target.aux_layer_ids) < 0:
            raise Eagle3Error(
                f"aux_layer_ids {target.aux_layer_ids} out of range for a "
                f"{config.num_hidden_layers}-layer target"
            )
        heads = config.num_attention_heads
        super().__init__(
            heads,
            config.num_key_value_heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads,
            config.rms_norm_eps,
            model.model.embed_tokens.weight.dtype,
        )
        self.aux_layer_ids = list(target.aux_layer_ids)
        self.embedding = model.model.embed_tokens.weight
        self.final_norm = model.model.norm.weight
        self.lm_head = model.lm_head.weight
        self.layers = [layer_weights(layer) for layer in model.model.layers]
        self.cos, self.sin = rotary_tables(model.model.rotary_emb, self.embedding, max_len)
        self.compiled = None

    def enter_layer(self, hidden, delta, input_norm, qkv, cos, sin):
        """A layer up to attention: the previous layer's MLP residual (`delta`), RMSNorm, the qkv
        GEMM, rotary -> (the hidden state entering the layer, split_heads' queries, its keys and
        values stacked [2, 1, kv_heads, q, dim] for one cache write)."""
        hidden = hidden + delta
        queries, keys, values = self.split_heads(
            F.linear(self.norm(hidden, input_norm), qkv), cos, sin
        )
        return hidden, queries, torch.stack([keys, values])

    def leave_layer(self, hidden, out, o, post_norm, gate_up, down):
        """A layer from attention's output on: o_proj and its residual, RMSNorm, the MLP -> (the
        hidden state after attention, the MLP's output, which the next enter_layer adds)."""
        hidden = hidden + F.linear(self.merge_heads(out), o)
        return hidden, gated_mlp(self.norm(hidden, post_norm), gate_up, down)

    def compiled_segments(self):
        """enter_layer and leave_layer through torch.compile: Inductor fuses each norm with its
        neighbours (the residual adds included), rotary and the K/V stacking into one kernel and
        silu * up into one (fewer kernels per replayed step). The cache write and attention stay
        outside: the cache is one buffer that all layers view."""
        if self.compiled is None:  # each verify length is one entry of a segment's compile cache
            self.compiled = tuple(
                compile_fixed(fn, dynamic=False) for fn in (self.enter_layer, self.leave_layer)
            )
        return self.compiled

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        kv: SlotKV,
        mask: torch.Tensor,
        compiled: bool = False,
    ):
        """ids/positions [q], kv prepared by the caller, mask bool [q, kv_len] (True = attend)
        -> (logits float32 [q, V], aux [q, len(aux_layer_ids) * H]). compiled: the layer's segments
        around attention run torch.compile'd (one compile per query length: fixed shapes only)."""
        cos, sin = self.cos[positions], self.sin[positions]
        bias = self.attention_bias(mask)
        hidden = F.embedding(ids, self.embedding)
        delta = torch.zeros_like(hidden)
        enter, leave = (
            self.compiled_segments() if compiled else (self.enter_layer, self.leave_layer)
        )
        entering = {}
        for index, layer in enumerate(self.layers):
            hidden, queries, new_kv = enter(hidden, delta, layer.input_norm, layer.qkv, cos, sin)
            entering[index] = hidden
            keys, values = kv.write_pair(index, new_kv)
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias)
            hidden, delta = leave(hidden, out, layer.o, layer.post_norm, layer.gate_up, layer.down)
        aux = torch.cat([entering[i] for i in self.aux_layer_ids], dim=-1)
        return F.linear(self.norm(hidden + delta, self.final_norm), self.lm_head).float(), aux


class LeanDrafter(LeanBlocks):
    """The drafter's step (Eagle3Drafter.forward, then .logits) in the same lean pieces; built
    once from an Eagle3Drafter, whose fused qkv and gate_up weights it copies."""

    @staticmethod
    def supports(drafter) -> bool:
        config = drafter.config
        rope_type = drafter.rotary_emb.rope_type
        return (
            config.hidden_act == "silu"
            and not getattr(config, "mlp_bias", False)
            and "dynamic" not in rope_type
            and rope_type != "longrope"
        )

    @torch.no_grad()
    def __init__(self, drafter, max_len: int, explicit_attention: bool = False):
        """explicit_attention: softmax(QK^T + bias)V in plain ops, not sdpa: inside a compiled, replayed
        draft step Inductor fuses the bias and softmax, where cuDNN's kernel brings a memset, a copy and a
        launch gap (H200, SmolLM2's d32s4k8: the draft phase 0.361 -> 0.352 ms a step, h200-2026-12-02)."""
        config = drafter.config
        self.explicit_attention = explicit_attention
        super().__init__(
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.rms_norm_eps,
            drafter.fc.weight.dtype,
        )
        self.embedding = drafter.embed_tokens.weight
        self.hidden_norm = drafter.layers[0].hidden_norm.weight
        self.final_norm, self.lm_head = drafter.norm.weight, drafter.lm_head.weight
        self.layers = [layer_weights(layer) for layer in drafter.layers]
        self.cos, self.sin = rotary_tables(drafter.rotary_emb, drafter.fc.weight, max_len)

    def forward(
        self,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv: SlotKV,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """ids/positions [q], hidden [q, H], kv prepared by the caller, mask bool [q, kv_len]
        -> the pre-norm hidden state [q, H] (the first layer reads cat(norm(embeds), norm(hidden)))."""
        cos, sin = self.cos[positions], self.sin[positions]
        bias = self.attention_bias(mask)
        embeds = F.embedding(ids, self.embedding).to(hidden.dtype)
        for index, layer in enumerate(self.layers):
            x = (
                torch.cat(
                    [self.norm(embeds, layer.input_norm), self.norm(hidden, self.hidden_norm)],
                    dim=-1,
                )
                if index == 0
                else self.norm(hidden, layer.input_norm)
            )
            hidden = hidden + self.attention(index, layer, x, cos, sin, kv, bias)
            hidden = hidden + gated_mlp(
                self.norm(hidden, layer.post_norm), layer.gate_up, layer.down
            )
        return hidden

    def attention(
        self, index: int, layer: LayerWeights, x, cos, sin, kv: SlotKV, bias
    ) -> torch.Tensor:
        queries, keys, values = self.split_heads(F.linear(x, layer.qkv), cos, sin)
        keys, values = kv.write(index, keys, values)
        if self.explicit_attention:
            scores = (queries @ keys.transpose(-1, -2)).float() * self.head_dim**-0.5 + bias
            out = torch.softmax(scores, dim=-1).to(values.dtype) @ values
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias)
        return F.linear(self.merge_heads(out), layer.o)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(hidden, self.final_norm), self.lm_head)


def compile_fixed(fn, **options):
    """torch.compile(fullgraph) for the engine's fixed-shape pieces. Dynamo's compile cache is per
    function, not per model or decoder, and torch's default limit of 8 entries is soon reached: one per
    verify length or cache width, for every decoder in the process (a spec sweep); past it Dynamo
    falls back to eager (with only a warning). The limit is raised process-wide."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, fullgraph=True, **options)


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def layer_weights(layer) -> LayerWeights:
    """A layer's weights for the lean pieces: q_proj's rows and o_proj's columns with the query
    heads reordered group-major (HF's head kv * groups + g becomes g * kv_heads + kv), the order
    split_heads and merge_heads lay heads out in; per-head math is unchanged."""
    attn, mlp = layer.self_attn, layer.mlp
    kv_heads, dim = attn.k_proj.weight.shape[0] // attn.head_dim, attn.head_dim
    q_rows = attn.q_proj.weight.unflatten(0, (kv_heads, -1, dim)).transpose(0, 1).flatten(0, 2)
    o_columns = attn.o_proj.weight.unflatten(1, (kv_heads, -1, dim)).transpose(1, 2).flatten(1)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        qkv=torch.cat([q_rows, attn.k_proj.weight, attn.v_proj.weight]),
        o=o_columns.contiguous(),
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        down=mlp.down_proj.weight,
    )


def rotary_tables(
    rotary_emb, weight: torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, head_dim] in weight's dtype from a model's own rotary embedding (any rope
    type or scaling gives HF's values); sin's first half is negated so rotate() needs no
    rotate_half negation."""
    positions = torch.arange(max_len, device=weight.device)[None]
    cos, sin = rotary_emb(weight[:1], positions)
    half = sin.shape[-1] // 2
    return cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin for x [q, heads, dim] and cos, sin [q, 1, dim]; the swapped
    halves come first so the result is laid out like them (contiguous)."""
    half = x.shape[-1] // 2
    return torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin + x * cos
