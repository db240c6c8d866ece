"""Batched forwards for continuous batching: the lean target's and the lean drafter's layers over
[B, q] tokens, one cache row per request.

The caches are engine/kv.py's SlotKV with batch = engine.max_batch_size: the requests in flight
occupy rows 0..B-1 (BatchDecoder keeps them packed), so a forward over rows lo..hi reads and writes a
view of the buffer, never a copy. Each row has its own slots and positions; the mask [B, q, kv_len]
says which of a row's first kv_len slots each of its queries sees, so rows of different lengths
share one attention call. The numbers per row are those of LeanLlama.forward / LeanDrafter.forward
(the same weights, the same order of operations).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3.engine.kv import SlotKV
from eagle3.engine.llama import LeanBlocks, LeanDrafter, LeanLlama, gated_mlp, rotate


def split_heads(blocks: LeanBlocks, qkv: torch.Tensor, cos, sin):
    """qkv [B, q, (heads + 2 kv_heads) * dim] -> queries [B, kv_heads, q * groups, dim] (the query
    heads sharing a KV head folded into the query length, token-major, as LeanBlocks.split_heads),
    keys and values [B, kv_heads, q, dim]."""
    batch, q_len = qkv.shape[:2]
    heads, kv_heads, dim = blocks.heads, blocks.kv_heads, blocks.head_dim
    qkv = qkv.view(batch, q_len, heads + 2 * kv_heads, dim)
    cos, sin = cos[:, :, None], sin[:, :, None]
    queries = rotate(qkv[:, :, :heads], cos, sin).reshape(batch, -1, kv_heads, dim).transpose(1, 2)
    keys = rotate(qkv[:, :, heads : heads + kv_heads], cos, sin).transpose(1, 2)
    return queries, keys, qkv[:, :, heads + kv_heads :].transpose(1, 2)


def merge_heads(blocks: LeanBlocks, out: torch.Tensor) -> torch.Tensor:
    """Attention's [B, kv_heads, q * groups, dim] -> [B, q, heads * dim] (o_proj's column order)."""
    batch = out.shape[0]
    return out.transpose(1, 2).reshape(batch, -1, blocks.heads * blocks.head_dim)


def attention_bias(blocks: LeanBlocks, mask: torch.Tensor) -> torch.Tensor:
    """Bool [B, q, kv_len] -> additive [B, 1, q * groups, kv_len] in the model's dtype."""
    bias = torch.zeros(mask.shape, dtype=blocks.dtype, device=mask.device)
    bias = bias.masked_fill(~mask, torch.finfo(blocks.dtype).min)
    return bias.repeat_interleave(blocks.heads // blocks.kv_heads, dim=1)[:, None]


def write_rows(kv: SlotKV, layer: int, rows: slice, slots: torch.Tensor, keys, values, kv_len):
    """Keys and values [B, kv_heads, q, dim] into cache rows `rows` at each row's slots [B, q]
    -> that layer's first kv_len slots of those rows (views)."""
    pair = torch.stack([keys, values]).to(kv.buffer.dtype)
    buffer = kv.buffer[:, layer, rows]
    index = slots[None, :, None, :, None].expand_as(pair)
    buffer.scatter_(3, index, pair)
    return buffer[0, :, :, :kv_len], buffer[1, :, :, :kv_len]


def move_slots(kv: SlotKV, rows: torch.Tensor, sources: torch.Tensor, dests: torch.Tensor) -> None:
    """Every layer's K/V at (rows[i], sources[i]) copied to (rows[i], dests[i]) (accepted paths)."""
    if rows.numel():
        kv.buffer[:, :, rows, :, dests] = kv.buffer[:, :, rows, :, sources]


def copy_row(kv: SlotKV, source: int, dest: int, length: int) -> None:
    """A request's first `length` slots moved from row `source` to row `dest` (packing rows)."""
    kv.buffer[:, :, dest, :, :length] = kv.buffer[:, :, source, :, :length]


def target_forward(lean: LeanLlama, kv: SlotKV, rows: slice, ids, positions, slots, mask):
    """ids/positions/slots [B, q], mask bool [B, q, kv_len] -> (logits float32 [B, q, V],
    aux [B, q, len(aux_layer_ids) * H])."""
    cos, sin = lean.cos[positions], lean.sin[positions]
    bias = attention_bias(lean, mask)
    hidden = F.embedding(ids, lean.embedding)
    delta = torch.zeros_like(hidden)
    entering = {}
    for index, layer in enumerate(lean.layers):
        hidden = hidden + delta
        entering[index] = hidden
        queries, keys, values = split_heads(
            lean, F.linear(lean.norm(hidden, layer.input_norm), layer.qkv), cos, sin
        )
        keys, values = write_rows(kv, index, rows, slots, keys, values, mask.shape[-1])
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias)
        hidden = hidden + F.linear(merge_heads(lean, out), layer.o)
        delta = gated_mlp(lean.norm(hidden, layer.post_norm), layer.gate_up, layer.down)
    aux = torch.cat([entering[i] for i in lean.aux_layer_ids], dim=-1)
    return F.linear(lean.norm(hidden + delta, lean.final_norm), lean.lm_head).float(), aux


def drafter_forward(
    lean: LeanDrafter, kv: SlotKV, rows: slice, ids, hidden, positions, slots, mask
):
    """ids/positions/slots [B, q], hidden [B, q, H] -> the drafter's pre-norm hidden [B, q, H]."""
    cos, sin = lean.cos[positions], lean.sin[positions]
    bias = attention_bias(lean, mask)
    embeds = F.embedding(ids, lean.embedding).to(hidden.dtype)
    for index, layer in enumerate(lean.layers):
        x = (
            torch.cat(
                [lean.norm(embeds, layer.input_norm), lean.norm(hidden, lean.hidden_norm)], dim=-1
            )
            if index == 0
            else lean.norm(hidden, layer.input_norm)
        )
        queries, keys, values = split_heads(lean, F.linear(x, layer.qkv), cos, sin)
        keys, values = write_rows(kv, index, rows, slots, keys, values, mask.shape[-1])
        if lean.explicit_attention:
            scores = (queries @ keys.transpose(-1, -2)).float() * lean.head_dim**-0.5 + bias
            out = torch.softmax(scores, dim=-1).to(values.dtype) @ values
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias)
        hidden = hidden + F.linear(merge_heads(lean, out), layer.o)
        hidden = hidden + gated_mlp(lean.norm(hidden, layer.post_norm), layer.gate_up, layer.down)
    return hidden
