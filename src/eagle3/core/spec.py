"""Speculation shapes (`spec.*`) validated with the engines' own rules before anything launches.

depth = tokens verified per step, the root included (SGLang --speculative-num-draft-tokens);
steps = drafter forward passes (--speculative-num-steps); topk = branching
(--speculative-eagle-topk). A chain (topk=1) has steps = depth-1 (SGLang forces
num_draft_tokens = num_steps + 1). vLLM drafts chains: num_speculative_tokens = steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3.core.common import Eagle3Error
from eagle3.core.config import SpecConfig


@dataclass(frozen=True)
class Spec:
    enabled: bool
    depth: int
    steps: int
    topk: int

    @property
    def chain(self) -> bool:
        return self.topk == 1

    @property
    def label(self) -> str:
        if not self.enabled:
            return "off"
        return f"d{self.depth}" if self.chain else f"d{self.depth}s{self.steps}k{self.topk}"


OFF = Spec(enabled=False, depth=1, steps=0, topk=1)


def max_tree_nodes(steps: int, topk: int) -> int:
    """Draft candidates an EAGLE-2 dynamic tree can offer: topk at step 1, then topk*topk per step
    (each of the topk kept leaves expands topk children)."""
    return topk + (steps - 1) * topk * topk


def resolve_spec(scfg: SpecConfig) -> Spec:
    """Validate `spec.*` and fill in derived fields; errors name the violated rule."""
    if not scfg.enabled:
        return OFF
    depth, steps, topk = scfg.depth, scfg.steps, scfg.topk
    if not isinstance(depth, int) or depth < 2:
        raise Eagle3Error(
            f"spec.depth={depth}: must be an integer >= 2 (tokens verified per step, root included); "
            "use spec=off for no speculation"
        )
    if not isinstance(topk, int) or topk < 1:
        raise Eagle3Error(f"spec.topk={topk}: must be an integer >= 1")
    if topk == 1:
        if steps is not None and steps != depth - 1:
            raise Eagle3Error(
                f"spec.steps={steps} with spec.topk=1 and spec.depth={depth}: a chain drafts depth-1 = "
                f"{depth - 1} steps (SGLang forces num_draft_tokens = num_steps + 1); drop spec.steps"
            )
        return Spec(True, depth, depth - 1, 1)
    if steps is None or not isinstance(steps, int) or steps < 1:
        raise Eagle3Error(
            f"spec.topk={topk} (a tree) needs spec.steps >= 1 (SGLang requires steps, topk and "
            "draft tokens together)"
        )
    if depth - 1 > max_tree_nodes(steps, topk):
        raise Eagle3Error(
            f"spec.depth={depth} exceeds the {max_tree_nodes(steps, topk)} draft candidates a tree "
            f"with spec.steps={steps}, spec.topk={topk} can offer (+1 root)"
        )
    return Spec(True, depth, steps, topk)
