"""Draft trees as flat tensors: node 0 is the root (the last committed token, its own parent).

The drafter grows an EAGLE-2 dynamic tree: the root's top-k children, then each step
expands the k best new leaves (by cumulative log-probability) by their top-k children;
finally the `depth - 1` best nodes are kept (log-probabilities at engine.tree_temperature,
default 1). Scores never rise along a path (a log-probability is never positive), and a stable
sort keeps creation order (parents before children) among ties, so the kept set always
contains every kept node's ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [q] target token ids, root first
    parents: torch.Tensor  # [q] parent node index (root -> 0), parents precede children
    depths: torch.Tensor  # [q] 0 for the root
    draft_probs: torch.Tensor | None = (
        None  # [q, V] sampling distribution per node (sampled chains)
    )

    @property
    def size(self) -> int:
        return self.tokens.numel()


def root_only(token: torch.Tensor) -> DraftTree:
    zero = torch.zeros(1, dtype=torch.long, device=token.device)
    return DraftTree(token.view(1), zero, zero.clone())


def top_children(
    logits: torch.Tensor, k: int, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, drafter-vocab ids) [rows, k] of each row's k likeliest tokens, best first.
    The log-sum-exp comes from the same chunks as the top-k, so one pass over the logits serves both.
    temperature: the log-probabilities are softmax(logits / temperature)'s (the scores that rank tree
    nodes); the ids are the same for every temperature > 0."""
    scaled = logits.float() if temperature == 1 else logits.float() / temperature
    blocks, maxima = chunks(scaled, k)
    values, indices = top_k_of_chunks(blocks, maxima, k)
    log_sum_exp = (maxima + (blocks - maxima[..., None]).exp().sum(dim=-1).log()).logsumexp(
        dim=-1, keepdim=True
    )
    return values - log_sum_exp, indices


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row [rows, n], best first, ties to the lower index: exactly a
    stable descending sort's first k, from two short sorts (torch.topk over a 32k vocab costs ~45
    GPU kernels)."""
    return top_k_of_chunks(*chunks(x, k), k)


def chunks(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [rows, n] cut into chunks [rows, n / c, c] (the tail padded with -inf) and their maxima."""
    rows, n = x.shape
    chunk = 1 << max(
        ((n // k) - 1).bit_length() // 2, 0
    )  # ~sqrt(n / k): both sorts ~sqrt(n k) long
    blocks = torch.nn.functional.pad(x, (0, -n % chunk), value=float("-inf")).view(rows, -1, chunk)
    return blocks, blocks.amax(dim=-1)


def top_k_of_chunks(
    blocks: torch.Tensor, maxima: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k from the chunks: the k chunks with the largest maxima (ties: the earlier chunk) hold the
    answer, since the chunk of an answer entry e has a maximum m >= e, and each chunk ranked before it
    holds an entry ranked before e (its maximum, or m itself), of which there are fewer than k."""
    rows, _, chunk = blocks.shape
    chosen = maxima.sort(dim=-1, descending=True, stable=True).indices[:, :k].sort(dim=-1).values
    candidates = blocks.gather(1, chosen[..., None].expand(-1, -1, chunk)).reshape(rows, -1)
    ids = (chosen[..., None] * chunk + torch.arange(chunk, device=blocks.device)).reshape(rows, -1)
    values, order = candidates.sort(dim=-1, descending=True, stable=True)
    return values[:, :k], ids.gather(-1, order[:, :k])


def keep_best(scores: torch.Tensor, parents: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the root plus the `count` best-scoring other nodes, in creation order."""
    order = torch.sort(scores[1:], descending=True, stable=True).indices[:count] + 1
    return torch.cat([torch.zeros(1, dtype=torch.long, device=scores.device), order.sort().values])


def subtree(
    nodes: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> DraftTree:
    """The tree restricted to `nodes` (ascending, closed under ancestors), re-indexed."""
    new_index = torch.zeros(tokens.numel(), dtype=torch.long, device=tokens.device)
    new_index[nodes] = torch.arange(nodes.numel(), device=tokens.device)
    return DraftTree(
        tokens[nodes],
        new_index[parents[nodes]],
        depths[nodes],
        None if draft_probs is None else draft_probs[nodes],
    )


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[q, q] bool: entry (i, j) is True when node j is node i or one of its ancestors.
    Built from comparisons only (no index writes), so it can sit inside a CUDA graph."""
    chain = [torch.arange(parents.numel(), device=parents.device)]
    for _ in range(max_depth):
        chain.append(parents[chain[-1]])
    lineage = torch.stack(chain, dim=1)  # [q, max_depth + 1]: each node, its parent, ...
    return (lineage[:, :, None] == chain[0][None, None, :]).any(dim=1)
