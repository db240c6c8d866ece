"""What `python -m eagle3.study` draws and writes from its results (study.json dicts): the fit
tau = a + b * ln(x) against training tokens and FLOPs, the plot with its extrapolation, the tables, and
several studies side by side."""

from __future__ import annotations

import json
import math
from pathlib import Path

from eagle3.core.common import Eagle3Error

FIT_AXES = (
    ("train_tokens", "training tokens, every epoch counted"),
    ("train_flops", "training FLOPs"),
)


# ---------------------------------------------------------------- the fit and the plot


def fit_log(xs: list[float], ys: list[float]) -> dict:
    """Least squares tau = a + b * ln(x): a, b, r2, and tau gained per doubling of x."""
    logs = [math.log(x) for x in xs]
    n, mean_x, mean_y = len(xs), sum(logs) / len(xs), sum(ys) / len(ys)
    sxx = sum((lx - mean_x) ** 2 for lx in logs)
    if n < 2 or sxx == 0:
        raise Eagle3Error("the fit needs at least two distinct sizes")
    b = sum((lx - mean_x) * (y - mean_y) for lx, y in zip(logs, ys)) / sxx
    a = mean_y - b * mean_x
    total = sum((y - mean_y) ** 2 for y in ys)
    residual = sum((y - (a + b * lx)) ** 2 for lx, y in zip(logs, ys))
    r2 = 1 - residual / total if total else 1.0
    return {"a": a, "b": b, "r2": r2, "per_doubling": b * math.log(2)}


def needed_for(fit: dict, tau: float) -> float | None:
    """The x at which the fitted line reaches tau (None when the fit does not rise)."""
    return math.exp((tau - fit["a"]) / fit["b"]) if fit["b"] > 0 else None


def fits_for(points: list[dict], goals) -> dict:
    """Per x axis (tokens, FLOPs) and measure (engine tau, val tau_hat): the fit and the goals' x."""
    fits = {}
    for axis, _ in FIT_AXES:
        for measure in ("engine_tau", "val_tau_hat"):
            usable = [p for p in points if p.get(measure) is not None]
            if len(usable) < 2:
                continue
            fit = fit_log([p[axis] for p in usable], [p[measure] for p in usable])
            fit["needed"] = {str(goal): needed_for(fit, float(goal)) for goal in goals}
            fits[f"{measure}~{axis}"] = fit
    return fits


def reference_points(references, points: list[dict]) -> list[dict]:
    """study.references as points: each names train_tokens (token passes) and engine_tau and/or
    val_tau_hat; its FLOPs follow the study's own FLOPs per token (same drafter and target shapes)."""
    per_token = points[0]["train_flops"] / points[0]["train_tokens"]
    refs = []
    for ref in references or []:
        if "train_tokens" not in ref or not ({"engine_tau", "val_tau_hat"} & set(ref)):
            raise Eagle3Error(
                f"study.references entry {dict(ref)}: give train_tokens and engine_tau or val_tau_hat"
            )
        refs.append(
            {
                "label": str(ref.get("label", "reference")),
                "train_tokens": float(ref["train_tokens"]),
                "train_flops": float(ref["train_tokens"]) * per_token,
                **{k: float(ref[k]) for k in ("engine_tau", "val_tau_hat") if k in ref},
            }
        )
    return refs


def plot(
    points: list[dict],
    fits: dict,
    extrapolate: float,
    title: str,
    path: Path,
    references: list[dict] = (),
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    epochs = sorted({p.get("epochs", 1) for p in points})
    for ax, (axis, label) in zip(axes, FIT_AXES):
        xs = [p[axis] for p in points]
        top = max([max(xs) * extrapolate, *(r[axis] * 1.5 for r in references)])
        grid = [min(xs) * (top / min(xs)) ** (i / 60) for i in range(61)]
        for measure, name, color in (
            ("engine_tau", "engine τ", "tab:blue"),
            ("val_tau_hat", "val τ̂", "tab:orange"),
        ):
            fit = fits.get(f"{measure}~{axis}")
            if fit is None:
                continue
            for epoch, marker in zip(epochs, "osD^v"):
                group = [p for p in points if p.get("epochs", 1) == epoch]
                ax.plot(
                    [p[axis] for p in group],
                    [p[measure] for p in group],
                    marker,
                    color=color,
                    label=f"{name}, {epoch} epoch(s)",
                )
            ax.plot(
                grid,
                [fit["a"] + fit["b"] * math.log(x) for x in grid],
                "--",
                color=color,
                label=f"{name} = {fit['a']:.2f} + {fit['b']:.3f} ln x (R² {fit['r2']:.2f})",
            )
        for ref in references:
            for measure, color in (("engine_tau", "tab:blue"), ("val_tau_hat", "tab:orange")):
                if measure in ref:
                    ax.plot(ref[axis], ref[measure], "*", color=color, markersize=12)
                    ax.annotate(
                        f"{ref['label']}: {ref[measure]:.2f}",
                        (ref[axis], ref[measure]),
                        fontsize=7,
                        xytext=(-150, -3),
                        textcoords="offset points",
                    )
        ax.axvline(max(xs), color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel(f"{label} (log; dotted: largest measured)")
        ax.set_ylabel("acceptance length τ")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(points: list[dict], suites: list[str]) -> str:
    head = ["rows", "epochs", "tokens", "FLOPs", "val τ̂", "engine τ", *suites, "train s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        cells = [
            f"{p['rows']:,}",
            str(p.get("epochs", "–")),
            f"{p['train_tokens']:,}",
            f"{p['train_flops']:.3g}",
            num(p.get("val_tau_hat")),
            num(p.get("engine_tau")),
            *(num(p["suite_tau"].get(s)) for s in suites),
            num(p.get("train_seconds"), 0),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fit_lines(fits: dict) -> str:
    lines = []
    for key, fit in fits.items():
        measure, axis = key.split("~")
        needed = ", ".join(
            f"τ {goal}: {value:.3g}" if value else f"τ {goal}: never"
            for goal, value in fit["needed"].items()
        )
        lines.append(
            f"- {measure} against {axis}: {fit['a']:.3f} + {fit['b']:.4f} ln x, R² {fit['r2']:.3f}, "
            f"{fit['per_doubling']:+.3f} τ per doubling; x for {needed}"
        )
    return "\n".join(lines)


def num(value, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


# ---------------------------------------------------------------- studies side by side


def labelled(paths: list[Path]) -> list[dict]:
    """The study.json files, each labelled by its study.label, else by the overrides not every one
    shares, else by its data hash."""
    results = []
    for path in paths:
        if not path.exists():
            raise Eagle3Error(f"study.compare: {path} does not exist (a study.json)")
        results.append(json.loads(path.read_text()))
    shared = set.intersection(*(set(r.get("overrides", [])) for r in results))
    for result in results:
        own = [o for o in result.get("overrides", []) if o not in shared]
        result["label"] = result.get("label") or " ".join(own) or f"data {result['data_hash']}"
    first = results[0]
    for path, other in zip(paths[1:], results[1:]):
        if (other["spec"], other["suites"]) != (first["spec"], first["suites"]):
            raise Eagle3Error(
                f"study.compare: {path} measured spec {other['spec']} on {other['suites']}, "
                f"{paths[0]} spec {first['spec']} on {first['suites']}: engine τ not comparable"
            )
    return results


def compare_table(results: list[dict]) -> str:
    """Each study's points (tokens, engine τ, per suite) and their difference from the first study's
    point at the nearest token count."""
    suites = results[0]["suites"]
    head = ["study", "tokens", "engine τ", "Δ first", *suites]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = results[0]["points"]
    for result in results:
        for point in result["points"]:
            near = min(base, key=lambda b: abs(math.log(b["train_tokens"] / point["train_tokens"])))
            cells = [
                result["label"],
                f"{point['train_tokens']:,}",
                num(point["engine_tau"]),
                f"{point['engine_tau'] - near['engine_tau']:+.3f}",
                *(num(point["suite_tau"].get(s)) for s in suites),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare_plot(results: list[dict], path: Path) -> Path:
    """Engine τ against training tokens with each study's fit; per suite, each study's τ at its
    largest size minus the first study's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    suites = results[0]["suites"]
    width = 0.8 / max(len(results) - 1, 1)
    for n, result in enumerate(results):
        xs = [p["train_tokens"] for p in result["points"]]
        ys = [p["engine_tau"] for p in result["points"]]
        color = f"C{n}"
        curves.plot(xs, ys, "o", color=color, label=result["label"])
        if len(xs) > 1 and len(set(xs)) > 1:
            fit = fit_log(xs, ys)
            grid = [min(xs), max(xs)]
            curves.plot(grid, [fit["a"] + fit["b"] * math.log(x) for x in grid], "--", color=color)
        if n:
            last, base = result["points"][-1], results[0]["points"][-1]
            deltas = [last["suite_tau"][s] - base["suite_tau"][s] for s in suites]
            bars.bar([i + (n - 1) * width for i in range(len(suites))], deltas, width, color=color)
    curves.set(
        xscale="log", xlabel="training tokens (log)", ylabel=f"engine τ ({results[0]['spec']})"
    )
    curves.grid(alpha=0.3, which="both")
    curves.legend(fontsize=7)
    bars.axhline(0, color="grey", lw=0.8)
    bars.set_xticks([i + width * (len(results) - 2) / 2 for i in range(len(suites))], suites)
    bars.set(ylabel=f"engine τ − {results[0]['label']}", title="at each study's largest size")
    bars.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
