"""Which tree shapes to bench on the GPU: τ measured anywhere, step cost from a GPU run.

τ depends on the target, the drafter and the prompts, not on the machine (up to low-precision
ties), so a grid of shapes can be decoded on a CPU; the GPU's step cost depends on the shape
mostly through the number of draft steps and their top-k (H200, results/smollm2-135m_h200_2026-12-01c.md: 0.10 ms per step at
k = 8, 0.17 at k = 16), and at batch 1 verify grows only slowly with the tree's size (1.39 ms at 8
nodes, 1.45 at 32, 1.52 at 64). From the spec rows of --gpu (engine-loop JSONs of one run) this fits
the draft time per draft step for each top-k (least squares through 0) and the rest of the all-in step
(verify, host, prefill share) as a line in the tree's size (least squares; flat when every row has
one size), and predicts for every spec row of --tau (another engine-loop JSON, e.g. a CPU run)

    tok/s = τ / (rest + per_node * depth + per_draft_step * steps)

its ratio to --gpu's spec=off, and the τ the shape would need for --target times spec=off:

    PYTHONPATH=benchmarks python benchmarks/tree_shapes.py --tau cpu_tree_grid.json [more.json] --gpu e2e_v32k_32.json \
        [more.json] [--plot tree_shapes.png]

Rows the --gpu files measured too print their measured tok/s beside the prediction.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from bench_engine import parse_spec


def totals(*paths: Path) -> dict[str, dict]:
    """Per method over all suites (and files): tokens, wall seconds, verify steps, draft seconds."""
    sums: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for row in (row for path in paths for row in json.loads(path.read_text())["rows"]):
        total = sums[row["method"]]
        for key in ("tokens", "wall_s", "verify_steps"):
            total[key] += row[key]
        total["draft_s"] += row["draft_ms_per_step"] * row["verify_steps"] / 1e3
    return dict(sums)


def fit_step(gpu: dict[str, dict]) -> tuple[float, float, dict[int, float]]:
    """(seconds per verify step besides drafting at size 0, their growth per verified node,
    draft seconds per draft step for each top-k) over the spec rows."""
    rows = [(parse_spec(m), t) for m, t in gpu.items() if m != "off"]
    if not rows:
        raise SystemExit("--gpu has no spec rows")
    per_step = {}
    for k in sorted({s.topk for s, _ in rows}):
        same_k = [(s, t) for s, t in rows if s.topk == k]
        per_step[k] = sum(s.steps * t["draft_s"] / t["verify_steps"] for s, t in same_k) / sum(
            s.steps**2 for s, _ in same_k
        )
    sizes = [s.depth for s, _ in rows]
    rests = [(t["wall_s"] - t["draft_s"]) / t["verify_steps"] for _, t in rows]
    mean_size, mean_rest = sum(sizes) / len(sizes), sum(rests) / len(rests)
    spread = sum((n - mean_size) ** 2 for n in sizes)
    per_node = (
        sum((n - mean_size) * (r - mean_rest) for n, r in zip(sizes, rests)) / spread
        if spread
        else 0.0
    )
    return mean_rest - per_node * mean_size, per_node, per_step


def plot(rows: list[dict], gpu: dict[str, dict], off: float, target: float, path: Path) -> None:
    """τ against step time: each --tau shape at its fitted step, each --gpu spec where it was measured,
    and lines of equal speedup over spec=off (τ = speedup x off tok/s x step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    predicted = [(r["tau"] / r["predicted_tok_per_s"] * 1e3, r["tau"], r["spec"]) for r in rows]
    measured = [
        (t["wall_s"] / t["verify_steps"] * 1e3, t["tokens"] / t["verify_steps"], m)
        for m, t in gpu.items()
        if m != "off"
    ]
    for points, marker, label in (
        (predicted, "o", "τ from --tau, fitted GPU step"),
        (measured, "^", "measured on the GPU"),
    ):
        ax.scatter([x for x, _, _ in points], [y for _, y, _ in points], marker=marker, label=label)
        for x, y, name in points:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    times = [x for x, _, _ in predicted + measured]
    span = [min(times) * 0.95, max(times) * 1.05]
    for speedup in sorted({2.0, target}):
        ax.plot(
            span,
            [speedup * off * ms / 1e3 for ms in span],
            "--",
            lw=1,
            label=f"{speedup:g}x spec=off",
        )
    ax.set_xlabel("step time (ms, all in)")
    ax.set_ylabel("τ (tokens per verify step)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tau",
        required=True,
        type=Path,
        nargs="+",
        help="engine-loop JSONs whose τ per shape is used",
    )
    parser.add_argument(
        "--gpu",
        required=True,
        type=Path,
        nargs="+",
        help="engine-loop JSONs from one GPU run, with spec=off",
    )
    parser.add_argument(
        "--target", type=float, default=2.5, help="speedup over spec=off whose τ each row reports"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--plot", type=Path, help="write τ against step time, with lines of equal speedup (PNG)"
    )
    args = parser.parse_args()
    gpu, measured = totals(*args.gpu), totals(*args.tau)
    if "off" not in gpu:
        raise SystemExit(f"no spec=off rows in {', '.join(map(str, args.gpu))}")
    base, per_node, per_step = fit_step(gpu)
    off = gpu["off"]["tokens"] / gpu["off"]["wall_s"]
    draft = ", ".join(f"{s * 1e3:.3f} ms at k={k}" for k, s in per_step.items())
    print(
        f"GPU step = {base * 1e3:.3f} ms + {per_node * 1e3:.4f} ms x verified nodes (verify, host, prefill) "
        f"+ draft steps x ({draft}); spec=off {off:.1f} tok/s"
    )
    rows = []
    for method, t in measured.items():
        if method == "off":
            continue
        spec, tau = parse_spec(method), t["tokens"] / t["verify_steps"]
        if spec.topk not in per_step:
            print(f"{method:>10}: no --gpu row with top-k {spec.topk} to price its draft steps")
            continue
        step_s = base + per_node * spec.depth + per_step[spec.topk] * spec.steps
        row = {
            "spec": method,
            "steps": spec.steps,
            "tau": tau,
            "predicted_tok_per_s": tau / step_s,
            "predicted_speedup": tau / step_s / off,
            "tau_for_target": args.target * off * step_s,
        }
        if method in gpu:
            row["gpu_tau"] = gpu[method]["tokens"] / gpu[method]["verify_steps"]
            row["gpu_tok_per_s"] = gpu[method]["tokens"] / gpu[method]["wall_s"]
        rows.append(row)
    for row in sorted(rows, key=lambda r: -r["predicted_tok_per_s"]):
        seen = (
            f"  (GPU: τ {row['gpu_tau']:.2f}, {row['gpu_tok_per_s']:.1f} tok/s)"
            if "gpu_tau" in row
            else ""
        )
        print(
            f"{row['spec']:>10}: τ {row['tau']:.2f} -> {row['predicted_tok_per_s']:7.1f} tok/s "
            f"({row['predicted_speedup']:.2f}x; {args.target:g}x needs τ {row['tau_for_target']:.2f}){seen}"
        )
    if args.plot:
        plot(rows, gpu, off, args.target, args.plot)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {"tau": list(map(str, args.tau)), "gpu": list(map(str, args.gpu))},
                    "base_s": base,
                    "per_node_s": per_node,
                    "per_step_s": per_step,
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
