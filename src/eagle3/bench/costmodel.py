"""Predict decode tok/s of chain depths that were not run.

A chain of depth D verifies D tokens per step and accepts on average
    tau(D) = 1 + sum_{i < D-1} a_i        (a_i: share of steps whose draft position i was accepted;
                                           the bonus token makes the 1)
Its step costs one verify plus D-1 draft forwards; on small batches both grow about linearly in
D, so step(D) = verify + draft_step * (D - 1) is fitted by least squares to the measured
(depth, step time) points, the no-speculation baseline being depth 1. Prediction: tau(D) / step(D).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    verify_s: float  # a verify step with no drafted tokens (the baseline decode step)
    draft_step_s: float  # added per extra depth: one draft forward + one more verified token

    def step_s(self, depth: int) -> float:
        return self.verify_s + self.draft_step_s * (depth - 1)


def fit_step_cost(points: list[tuple[int, float]]) -> StepCost | None:
    """Least-squares line through (depth, seconds per step); None with fewer than 2 depths."""
    depths = {d for d, _ in points}
    if len(depths) < 2:
        return None
    n = len(points)
    mean_x = sum(d - 1 for d, _ in points) / n
    mean_y = sum(t for _, t in points) / n
    sxx = sum((d - 1 - mean_x) ** 2 for d, _ in points)
    sxy = sum((d - 1 - mean_x) * (t - mean_y) for d, t in points)
    slope = sxy / sxx
    return StepCost(verify_s=mean_y - slope * mean_x, draft_step_s=slope)


def accept_length(per_pos: list[float], depth: int) -> float | None:
    """tau for a chain of `depth` from per-position acceptance (None past the measured positions)."""
    if depth - 1 > len(per_pos):
        return None
    return 1.0 + sum(per_pos[: depth - 1])


def predict(per_pos: list[float], cost: StepCost, depths: list[int]) -> dict[int, float]:
    """Predicted decode tok/s per depth (depths beyond the measured positions are skipped)."""
    out = {}
    for depth in depths:
        tau = accept_length(per_pos, depth)
        if tau is not None and cost.step_s(depth) > 0:
            out[depth] = tau / cost.step_s(depth)
    return out
