"""Repeated measurements and what a sweep may say about them.

A job runs its prompt suite `bench.repeats` times on one warm engine. Its tok/s is the median of
those passes, its spread the min-max range. Speedup is median over median; its range divides the
job's extremes by the baseline's opposite extremes. Two measurements whose ranges overlap are a
tie, and a tie goes to the cheaper shape (fewer tokens verified per step; spec=off verifies one).

The verdict of a group of jobs (same engine, suite, batch size, max tokens, baseline) names the
winner only when it beat spec=off beyond noise, never a shape whose tau says it drafts almost nothing
(bench.accepts_nothing_tau), and never from a sweep too small to separate shapes from noise (fewer
prompts or passes than bench.winner_min_prompts / bench.winner_min_repeats: it says so); it always
states the fastest shape's ratio and the cost model's predicted best shape with its predicted ratio.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

SPREAD_KEYS = ("tokens_per_s", "decode_tokens_per_s")  # metrics reported with a min-max range
OFF_LABEL = "spec=off"
ACCEPTS_NOTHING = "the engine accepts almost nothing: check the export"


@dataclass(frozen=True)
class Rules:
    """What a verdict may conclude from: shapes with tau under accepts_nothing_tau never win; a
    sweep of fewer than min_prompts prompts per pass or min_repeats passes (`repeats`: the passes a
    job was asked for, bench.repeats) names no winner."""

    accepts_nothing_tau: float = 0.0
    min_prompts: int = 0
    min_repeats: int = 0
    repeats: int | None = None

    @classmethod
    def of(cls, bench) -> Rules:
        return cls(
            float(bench.accepts_nothing_tau),
            int(bench.winner_min_prompts),
            int(bench.winner_min_repeats),
            int(bench.repeats),
        )


@dataclass(frozen=True)
class Spread:
    """The median of repeated measurements and their min-max range."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    @classmethod
    def from_result(cls, result: dict, key: str) -> Spread:
        value = result[key]
        return cls(value, result.get(f"{key}_min", value), result.get(f"{key}_max", value))

    def overlaps(self, other: Spread) -> bool:
        return self.low <= other.high and other.low <= self.high

    def apart(self, other: Spread) -> bool:
        """The ranges are apart by more than the wider of the two: a further pass landing within
        the spread seen so far leaves them apart (bench.min_repeats stops a job's passes there)."""
        width = max(self.high - self.low, other.high - other.low)
        return self.low - other.high > width or other.low - self.high > width

    def over(self, base: Spread) -> Spread:
        """This / base: the ratio of medians, the range from the extremes."""
        return Spread(self.median / base.median, self.low / base.high, self.high / base.low)


# ---------------------------------------------------------------- one job's repeats


def combine_repeats(passes: list[dict]) -> dict:
    """One job's metrics from its passes: every number is the median over passes, tok/s also gets
    `_min`, `_max` and the per-pass values; lists (per-position acceptance) come from the pass with
    the median tok/s."""
    ranked = sorted(passes, key=lambda p: p["tokens_per_s"])
    middle = ranked[(len(ranked) - 1) // 2]
    combined = dict(middle)
    for key, value in middle.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            combined[key] = statistics.median(p[key] for p in passes if key in p)
    for key in SPREAD_KEYS:
        values = [p[key] for p in passes if key in p]
        if values:
            combined.update({f"{key}_min": min(values), f"{key}_max": max(values)})
            combined[f"{key}_runs"] = values
    combined["repeats"] = len(passes)
    return combined


def speedup_fields(metrics: dict, base: dict) -> dict:
    """speedup (median / median) and its range against the baseline's spread."""
    ratio = Spread.from_result(metrics, "tokens_per_s").over(
        Spread.from_result(base, "tokens_per_s")
    )
    return {"speedup": ratio.median, "speedup_min": ratio.low, "speedup_max": ratio.high}


# ---------------------------------------------------------------- comparing jobs


def cost(result: dict) -> tuple:
    """What a shape spends per step: tokens verified, then draft forwards."""
    if result["spec"] == "off":
        return (1, 0)
    return (result["depth"], result.get("steps") or 0)


def baseline_row(jobs: list[dict]) -> dict:
    """The group's spec=off measurement as a row like a job's."""
    first = jobs[0]
    return {
        "spec": "off",
        "depth": 1,
        "steps": 0,
        "topk": 1,
        "tokens_per_s": first["baseline_tokens_per_s"],
        "tokens_per_s_min": first.get("baseline_tokens_per_s_min", first["baseline_tokens_per_s"]),
        "tokens_per_s_max": first.get("baseline_tokens_per_s_max", first["baseline_tokens_per_s"]),
        "speedup": 1.0,
        "speedup_min": 1.0,
        "speedup_max": 1.0,
        "accept_length": 1.0,
    }


def against_off(result: dict, base: dict) -> str:
    """faster | slower | tie: this job's tok/s range against spec=off's."""
    mine, off = Spread.from_result(result, "tokens_per_s"), Spread.from_result(base, "tokens_per_s")
    if mine.overlaps(off):
        return "tie"
    return "faster" if mine.low > off.high else "slower"


def too_small(jobs: list[dict], rules: Rules) -> str:
    """Why the group's sweep cannot separate shapes from noise (empty: it can): fewer prompts per
    pass (the jobs' `requests`) or fewer passes than the rules ask for."""
    prompts = min((j["requests"] for j in jobs if "requests" in j), default=None)
    passes = rules.repeats if rules.repeats is not None else max(j.get("repeats", 1) for j in jobs)
    counts = []
    if prompts is not None and prompts < rules.min_prompts:
        counts.append(f"{prompts} prompts per pass (bench.winner_min_prompts={rules.min_prompts})")
    if passes < rules.min_repeats:
        counts.append(f"{passes} passes per job (bench.winner_min_repeats={rules.min_repeats})")
    if not counts:
        return ""
    return "the sweep is too small to separate shapes from noise: " + " and ".join(counts)


def winner(jobs: list[dict], rules: Rules = Rules()) -> tuple[dict, dict, list[dict]]:
    """(winner, fastest, tied): the fastest shape by median tok/s among those that draft (tau at
    least rules.accepts_nothing_tau) and every such row (spec=off included) whose range overlaps
    it. The winner is spec=off unless the fastest beat it beyond noise in a sweep large enough to
    tell (too_small); then the cheapest of the tied shapes."""
    base = baseline_row(jobs)
    shapes = [j for j in jobs if j["spec"] != "off"]
    drafting = [j for j in shapes if not accepts_nothing(j, rules.accepts_nothing_tau)]
    fastest = max(drafting or shapes or [base], key=lambda r: r["tokens_per_s"])
    top = Spread.from_result(fastest, "tokens_per_s")
    tied = [r for r in [base, *drafting] if Spread.from_result(r, "tokens_per_s").overlaps(top)]
    if not drafting or against_off(fastest, base) != "faster" or too_small(jobs, rules):
        return base, fastest, tied
    return min(tied, key=cost), fastest, tied


def describe(result: dict) -> str:
    tok = Spread.from_result(result, "tokens_per_s")
    name = OFF_LABEL if result["spec"] == "off" else result["spec"]
    text = f"{name}: {tok.median:.1f} tok/s ({tok.low:.1f}-{tok.high:.1f})"
    if result["spec"] == "off":
        return text
    return f"{text} = {ratio_text(result, ' spec=off')}, tau {result['accept_length']:.2f}"


def ratio_text(result: dict, of: str = "") -> str:
    """'0.65x spec=off (0.60-0.70x)': the speedup's median and its range."""
    ratio = Spread.from_result(result, "speedup")
    return f"{ratio.median:.2f}x{of} ({ratio.low:.2f}-{ratio.high:.2f}x)"


def predicted_best(model_rows: list[dict], baseline_step_s: float) -> tuple[int, float] | None:
    """(depth, predicted ratio to spec=off) of the cost model's fastest chain for one group."""
    if not model_rows:
        return None
    best = max(model_rows, key=lambda r: r["predicted_tok_s"])
    return best["depth"], best["predicted_tok_s"] * baseline_step_s


def accepts_nothing(result: dict, below_tau: float) -> bool:
    """A speculative job whose drafts the engine (almost) never accepts: tau under below_tau
    (bench.accepts_nothing_tau). The symptom of a drafter whose weights the engine ignored."""
    return result.get("spec") != "off" and result.get("accept_length", 1.0) < below_tau


def accepts_nothing_line(shapes: list[dict], below_tau: float) -> list[str]:
    """The warning for the shapes whose tau is under below_tau (none: no line)."""
    nothing = [r for r in shapes if accepts_nothing(r, below_tau)]
    if not nothing:
        return []
    taus = ", ".join(f"{r['spec']} tau {r['accept_length']:.2f}" for r in nothing)
    return [
        f"{ACCEPTS_NOTHING} ({taus}, under {below_tau:g}): weights the engine does not load "
        "(names, shapes, aux layer ids) leave it drafting at random"
    ]


def verdict_lines(jobs: list[dict], model_rows: list[dict], rules: Rules = Rules()) -> list[str]:
    """What one group's sweep showed, in plain words; every ratio is against spec=off measured as
    the jobs' baseline (reused from an earlier sweep only when asked, and then said so)."""
    base = baseline_row(jobs)
    lines = [f"  {describe(base)}{reuse_note(jobs[0])}"]
    shapes = [r for r in jobs if r["spec"] != "off"]
    lines += [f"  {describe(r)}: {verdict_word(against_off(r, base))}" for r in shapes]
    lines += accepts_nothing_line(shapes, rules.accepts_nothing_tau)
    chosen, fastest, tied = winner(jobs, rules)
    small = too_small(jobs, rules)
    if shapes and all(accepts_nothing(r, rules.accepts_nothing_tau) for r in shapes):
        lines.append(
            f"no winner: every shape's tau is under {rules.accepts_nothing_tau:g} (it drafts "
            "almost nothing), whatever its tok/s"
        )
    elif chosen["spec"] == "off" and small and against_off(fastest, base) == "faster":
        lines.append(
            f"no winner: {small}; the fastest, {fastest['spec']}, ran at {ratio_text(fastest)} "
            "of spec=off"
        )
    elif chosen["spec"] == "off":
        how = "all slower" if against_off(fastest, base) == "slower" else "within noise"
        lines.append(
            f"no shape beat spec=off on this machine ({how}): the fastest, {fastest['spec']}, "
            f"ran at {ratio_text(fastest)} of spec=off"
        )
    else:
        lines.append(f"winner: {chosen['spec']} at {ratio_text(chosen, ' spec=off')}")
        if chosen is not fastest:
            others = ", ".join(r["spec"] for r in tied if r is not chosen)
            lines[-1] += (
                f"; it ties with {others} (overlapping tok/s ranges) and verifies fewer tokens"
            )
    predicted = predicted_best(model_rows, jobs[0].get("baseline_step_s") or 0.0)
    if predicted:
        depth, ratio_hat = predicted
        lines.append(
            f"cost model: depth {depth} predicted fastest here at {ratio_hat:.2f}x spec=off "
            f"(try spec.depth={depth})"
            if ratio_hat > 1
            else f"cost model: no chain predicted to beat spec=off here (the best, depth {depth}, "
            f"at {ratio_hat:.2f}x)"
        )
    return lines


def verdict_word(relation: str) -> str:
    return {
        "faster": "faster than spec=off",
        "slower": "slower than spec=off",
        "tie": "a tie with spec=off (ranges overlap)",
    }[relation]


def reuse_note(job: dict) -> str:
    if not job.get("baseline_reused"):
        return ", measured in this sweep"
    age_min = (job.get("baseline_age_s") or 0.0) / 60
    return (
        f", REUSED from run {job.get('baseline_run_id')} measured {age_min:.0f} min ago "
        "(bench.reuse_baseline=true)"
    )
