"""A search over speculation shapes instead of a grid: `python -m eagle3.bench -m search=shapes`
(conf/search/shapes.yaml) runs hydra-optuna-sweeper (`hydra/sweeper=optuna`) over spec.depth x
spec.topk x spec.steps for the highest median tok/s, any Hydra launcher running the jobs.

Two pieces plug into the sweeper:
- CostModelSampler (hydra/sweeper/sampler=cost_model): the first trials are chains at
  `probe_depths`; their step times and per-position acceptance (eagle3.bench.costmodel, through the
  sweep summary's cost_model_rows) predict the tok/s of every chain depth in the space, and the
  predicted best depth is the next trial. Optuna's TPE sampler proposes the rest.
- No shape twice: a TPE proposal that would repeat a shape another trial already measured (or is
  measuring) becomes the nearest choice that does not (unmeasured()).
- tree_steps (custom_search_space): spec.steps is searched only for trees (topk > 1); a chain
  drafts depth-1 steps, so its trials carry no spec.steps.
A job returns its median tok/s to the sweeper (0 for a failed job: ranked last, the search goes on);
the sweep callback's parent run, child runs and summary are the same as a grid's.
"""

from __future__ import annotations

import json
from pathlib import Path

import optuna
from omegaconf import DictConfig

from eagle3.bench.sweep import cost_model_rows
from eagle3.core.common import log
from eagle3.core.spec import max_tree_nodes

DEPTH, TOPK, STEPS = "spec.depth", "spec.topk", "spec.steps"


def tree_steps(cfg: DictConfig, trial: optuna.trial.Trial) -> None:
    """spec.steps for trees only, in [search.min_steps, search.max_steps] and no fewer than the
    tree needs to offer depth-1 candidates (eagle3.core.spec.max_tree_nodes). Hydra's Optuna sweeper
    calls it (custom_search_space) with the composed config, untyped."""
    topk = int(trial.params.get(TOPK, 1))
    if topk == 1:
        return
    depth = int(trial.params[DEPTH])
    needed = next(s for s in range(1, depth + 1) if max_tree_nodes(s, topk) >= depth - 1)
    low = max(int(cfg.search.min_steps), needed)
    trial.suggest_int(STEPS, low, max(int(cfg.search.max_steps), low))


def sweep_results(sweep_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/bench_result.json"))]


def predicted_best_depth(results: list[dict], depths: list[int]) -> tuple[int, float] | None:
    """The chain depth with the highest predicted decode tok/s among `depths` (the cost model fitted
    on the measured chains and the baseline); None without two measured depths."""
    rows = [r for r in cost_model_rows(results, depths) if r["depth"] in depths]
    if not rows:
        return None
    best = max(rows, key=lambda r: r["predicted_tok_s"])
    return int(best["depth"]), float(best["predicted_tok_s"])


def depth_choices(distribution) -> list[int]:
    if hasattr(distribution, "choices"):
        return sorted(int(c) for c in distribution.choices)
    step = int(getattr(distribution, "step", 1) or 1)
    return list(range(int(distribution.low), int(distribution.high) + 1, step))


class CostModelSampler(optuna.samplers.BaseSampler):
    """Chains at `probe_depths` first, then the cost model's best chain depth, then TPE."""

    def __init__(self, sweep_dir: str, probe_depths: list[int], seed: int | None = None) -> None:
        self.sweep_dir = Path(sweep_dir)
        self.probe_depths = [int(d) for d in probe_depths]
        self.tpe = optuna.samplers.TPESampler(seed=seed)
        self.seeded: dict[int, dict] = {}
        self.depths: list[int] = []  # the depth space, seen at the first trial

    def infer_relative_search_space(self, study, trial):
        return self.tpe.infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        if self.planned(trial.number) is not None:
            return {}
        return self.tpe.sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        if param_name == DEPTH and not self.depths:
            self.depths = depth_choices(param_distribution)
        planned = self.planned(trial.number)
        if planned is not None and param_name in planned:
            return planned[param_name]
        value = self.tpe.sample_independent(study, trial, param_name, param_distribution)
        return unmeasured(value, param_name, param_distribution, trial, study)

    def after_trial(self, study, trial, state, values) -> None:
        self.tpe.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.tpe.reseed_rng()

    def planned(self, number: int) -> dict | None:
        """The chain trial `number` is fixed to (a probe, then the prediction), None for TPE's."""
        if number < len(self.probe_depths):  # inside the searched depths when they are known
            depth = self.probe_depths[number]
            if self.depths:
                depth = min(max(depth, self.depths[0]), self.depths[-1])
            return {DEPTH: depth, TOPK: 1}
        if number != len(self.probe_depths) or not self.depths:
            return None
        if number not in self.seeded:
            best = predicted_best_depth(sweep_results(self.sweep_dir), self.depths)
            probed = {self.planned(n)[DEPTH] for n in range(len(self.probe_depths))}
            if best is not None and best[0] not in probed:
                log.info("shape search: the cost model predicts chain depth %d (%.1f tok/s)", *best)
                self.seeded[number] = {DEPTH: best[0], TOPK: 1}
            else:
                self.seeded[number] = {}
        return self.seeded.get(number) or None


# ---------------------------------------------------------------- no shape measured twice


def shape_of(params: dict) -> tuple:
    """A trial's speculation shape: (depth, topk, steps); a chain has no steps of its own."""
    topk = int(params.get(TOPK, 1))
    return (int(params[DEPTH]), topk, int(params[STEPS]) if topk > 1 and STEPS in params else None)


def taken_shapes(study, trial) -> set[tuple]:
    """The shapes of every other trial of the study (finished, failed or running)."""
    return {
        shape_of(t.params)
        for t in study.get_trials(deepcopy=False)
        if t.number != trial.number and DEPTH in t.params
    }


def choices_of(distribution) -> list:
    if hasattr(distribution, "choices"):
        return list(distribution.choices)
    return depth_choices(distribution)


def unmeasured(value, name: str, distribution, trial, study):
    """TPE's proposal for `name`, or, when it would repeat an already-measured shape, the nearest
    choice that does not (a repeated shape is a wasted trial). Depth is decided first: a depth
    whose chain is measured is avoided only when chains are all the search tries (topk 1)."""
    if name not in (DEPTH, TOPK, STEPS):
        return value
    taken = taken_shapes(study, trial)
    topks = next(
        (choices_of(t.distributions[TOPK]) for t in study.trials if TOPK in t.distributions), [1]
    )

    def repeats(candidate) -> bool:
        params = {**trial.params, name: candidate}
        if name == DEPTH:
            return topks == [1] and shape_of({**params, TOPK: 1}) in taken
        if name == TOPK:
            return int(candidate) == 1 and shape_of(params) in taken
        return shape_of(params) in taken

    if not repeats(value):
        return value
    numeric = name != TOPK
    options = choices_of(distribution)
    if numeric:
        options = sorted(options, key=lambda c: abs(c - value))
    return next((c for c in options if not repeats(c)), value)
