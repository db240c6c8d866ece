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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle3.engine.kv import SlotKV
from eagle3.engine.llama import LeanBlocks, LeanDrafter, LeanLlama, gated_mlp, rotate


@dataclass
class BatchTrees:
    """Every row's draft tree, [B, q] each (q = spec.depth; 1 with spec=off)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    sizes: list[int]  # nodes of each row's tree that count (1: the row verifies its root only)
    draft_probs: dict[int, torch.Tensor]  # row -> [q, V] (sampled chains)


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


def permute_slots(kv: SlotKV, rows: int, position: torch.Tensor, order: torch.Tensor) -> None:
    """Rows 0..rows-1: every layer's K/V at slots position + order[b, i] moved to position + i
    (accepted path first, the rest after it, where nothing attends before it is rewritten)."""
    buffer = kv.buffer[:, :, :rows]
    two, layers, _, heads, _, dim = buffer.shape
    offsets = torch.arange(order.shape[1], device=order.device)
    expand = lambda slots: slots[None, None, :, None, :, None].expand(
        two, layers, rows, heads, -1, dim
    )
    moved = buffer.gather(4, expand(position[:, None] + order))
    buffer.scatter_(4, expand(position[:, None] + offsets), moved)


def copy_row(kv: SlotKV, source: int, dest: int, length: int) -> None:
    """A request's first `length` slots moved from row `source` to row `dest` (packing rows)."""
    kv.buffer[:, :, dest, :, :length] = kv.buffer[:, :, source, :, :length]


def target_forward(lean: LeanLlama, kv: SlotKV, rows: slice, ids, positions, slots, mask):
    """ids/positions/slots [B, q], mask bool [B, q, kv_len] -> (logits [B, q, V] (float32 or wider),
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
    logits = F.linear(lean.norm(hidden + delta, lean.final_norm), lean.lm_head)
    # float32 at least; float64 (engine.deterministic) stays float64
    return logits.to(torch.promote_types(logits.dtype, torch.float32)), aux


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


# ---------------------------------------------------------------- row-wise tree and mask pieces


def causal(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[B, m, kv_len]: the query at slot positions[b, i] sees every slot up to its own."""
    cols = torch.arange(kv_len, device=positions.device)
    return cols[None, None, :] <= positions[:, :, None]


def tree_mask(position: torch.Tensor, ancestors: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[B, q, kv_len]: each row's committed prefix (slots < position) and its tree's ancestors
    (slots position..position+q-1)."""
    q = ancestors.shape[-1]
    cols = torch.arange(kv_len, device=position.device)
    relative = cols[None, :] - position[:, None]  # [B, kv_len]
    inside = (relative >= 0) & (relative < q)
    picked = ancestors.gather(2, relative.clamp(0, q - 1)[:, None, :].expand(-1, q, -1))
    return (relative < 0)[:, None, :] | (inside[:, None, :] & picked)


def draft_mask(frontier, slot_of, parents, position, step: int, kv_len: int) -> torch.Tensor:
    """[B, w, kv_len]: frontier nodes (depth `step`) see their row's committed prefix and their
    ancestors' draft slots."""
    batch, width = frontier.shape
    cols = torch.arange(kv_len, device=frontier.device)
    mask = (cols[None, None, :] < position[:, None, None]).expand(batch, width, kv_len).clone()
    current = frontier
    for _ in range(step):
        mask.scatter_(2, slot_of.gather(1, current)[:, :, None], True)
        current = parents.gather(1, current)
    return mask


def ancestor_masks(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, q, q]: entry (b, i, j) is True when node j is node i or one of its ancestors in row b."""
    batch, q = parents.shape
    chain = [torch.arange(q, device=parents.device).expand(batch, q)]
    for _ in range(max_depth):
        chain.append(parents.gather(1, chain[-1]))
    lineage = torch.stack(chain, dim=2)  # [B, q, depth + 1]
    return (lineage[:, :, :, None] == chain[0][:, None, None, :]).any(dim=2)


def counted_ancestors(parents: torch.Tensor, sizes: torch.Tensor, max_depth: int):
    """ancestor_masks restricted to the nodes each row verifies (the first sizes[b]), every node its
    own ancestor -> (ancestors [B, q, q], counted [B, q])."""
    q = parents.shape[1]
    counted = sizes[:, None] > torch.arange(q, device=parents.device)
    ancestors = ancestor_masks(parents, max_depth) & counted[:, None, :]
    return ancestors | torch.eye(q, dtype=torch.bool, device=parents.device), counted


def keep_best_rows(scores: torch.Tensor, count: int) -> torch.Tensor:
    """[B, count + 1]: per row the root and its `count` best-scoring nodes, in creation order
    (tree.keep_best row by row)."""
    order = torch.sort(scores[:, 1:], dim=1, descending=True, stable=True).indices[:, :count] + 1
    root = torch.zeros(scores.shape[0], 1, dtype=torch.long, device=scores.device)
    return torch.cat([root, order.sort(dim=1).values], dim=1)


def subtrees(nodes, tokens, parents, depths) -> BatchTrees:
    """Each row's tree restricted to its `nodes` (ascending, closed under ancestors), re-indexed."""
    new_index = torch.zeros_like(tokens)
    arange = torch.arange(nodes.shape[1], device=nodes.device).expand_as(nodes)
    new_index.scatter_(1, nodes, arange)
    return BatchTrees(
        tokens.gather(1, nodes),
        new_index.gather(1, parents.gather(1, nodes)),
        depths.gather(1, nodes),
        [nodes.shape[1]] * nodes.shape[0],
        {},
    )
