"""Choosing tokens and accepting drafts without changing the target's distribution.

Greedy: walk the tree while a child carries the target's argmax; the bonus token is the
argmax at the last accepted node.

Sampling (temperature > 0): at each node the children are tried in order.
- A child drafted deterministically (tree top-k) is accepted with probability p(c) under
  the current residual p; on rejection p(c) is zeroed and p renormalised. Trying
  candidates this way draws exactly from p: P(c_i) = prod_{j<i}(1 - p_j') p_i' = p(c_i).
- A child sampled from the drafter's q (a chain) is accepted with min(1, p/q); on
  rejection p becomes norm(max(p - q, 0)) (standard speculative sampling).
If no child is accepted the bonus token is drawn from the residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sampling:
    """How one request chooses tokens: greedy at temperature 0, else drawn with `generator`."""

    temperature: float
    top_p: float
    generator: torch.Generator

    @property
    def random(self) -> bool:
        return self.temperature > 0


def probabilities(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Softmax(logits / temperature) restricted to the top-p nucleus, renormalised (float32).
    A temperature beyond float32's range (1e308 is a valid request) divides in float64: in float32
    it would be inf, and a token masked out with -inf logits (outside the draft vocabulary) would
    turn every probability into NaN."""
    wide = temperature > torch.finfo(torch.float32).max
    scaled = logits.double() / temperature if wide else logits.float() / temperature
    probs = torch.softmax(scaled, dim=-1).float()
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p  # the first token always stays
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    nucleus = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return nucleus / nucleus.sum(dim=-1, keepdim=True)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))


def children_of(parents: list[int]) -> list[list[int]]:
    """Children lists in node order (node 0 is the root, its own parent)."""
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents[1:], start=1):
        children[parent].append(node)
    return children


def greedy_path(tokens: list[int], parents: list[int], argmax: list[int]) -> tuple[list[int], int]:
    """Longest path from the root whose every token is the target's argmax at its parent;
    returns (node indices from the root, bonus token)."""
    children = children_of(parents)
    path = [0]
    while True:
        want = argmax[path[-1]]
        match = next((c for c in children[path[-1]] if tokens[c] == want), None)
        if match is None:
            return path, want
        path.append(match)


def sampled_path(
    tokens: list[int],
    parents: list[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """Multi-candidate speculative sampling over the tree. target_probs [N, V]: the target's
    distribution at each node; draft_probs [N, V] (chains) or None (deterministic children)."""
    children = children_of(parents)
    path = [0]
    while True:
        residual = target_probs[path[-1]].float().cpu().clone()
        accepted = None
        for child in children[path[-1]]:
            token = tokens[child]
            if draft_probs is None:
                accepted = child if _coin(generator) < residual[token] else None
                if accepted is None:
                    residual[token] = 0.0
                    residual = _normalise(residual, target_probs[path[-1]])
            else:
                q = draft_probs[child].float().cpu()
                ratio = residual[token] / q[token] if q[token] > 0 else torch.tensor(1.0)
                accepted = child if _coin(generator) < min(1.0, float(ratio)) else None
                if accepted is None:
                    residual = _normalise((residual - q).clamp_min(0.0), target_probs[path[-1]])
            if accepted is not None:
                break
        if accepted is None:
            return path, draw(residual, generator)
        path.append(accepted)


def _coin(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator))


def _normalise(residual: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = residual.sum()
    if total <= 0:  # only by rounding, when acceptance was certain
        return fallback.float().cpu()
    return residual / total
