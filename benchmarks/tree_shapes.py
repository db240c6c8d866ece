"""Which tree shapes to bench on the GPU: τ measured anywhere, step cost from a GPU run.

τ depends on the target, the drafter and the prompts, not on the machine (up to low-precision
ties), so a grid of shapes can be decoded on a CPU; the GPU's step cost depends on the shape
mostly through the number of draft steps: at batch 1 verify is about flat in the tree's size
(1.39-1.52 ms for 6-24 nodes on the H200, not monotonic) and a draft step costs about the same for any
top-k. From the spec rows of --gpu (an e2e_bench.py JSON) this takes the draft time per draft step
(least squares through 0), the mean verify time and the mean rest of the all-in step (host, prefill
share), and predicts for every spec row of --tau (another e2e_bench.py JSON, e.g. a CPU run)

    tok/s = τ / (rest + verify + per_draft_step * steps)

and its ratio to --gpu's spec=off:

    PYTHONPATH=benchmarks python benchmarks/tree_shapes.py --tau cpu_tree_grid.json [more.json] --gpu e2e_v32k_32.json

Rows the --gpu file measured too print their measured tok/s beside the prediction.
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


def fit_step(gpu: dict[str, dict]) -> tuple[float, float]:
    """(seconds per verify step besides drafting, draft seconds per draft step) over the spec rows."""
    rows = [(parse_spec(m).steps, t) for m, t in gpu.items() if m != "off"]
    if not rows:
        raise SystemExit("--gpu has no spec rows")
    per_step = sum(s * t["draft_s"] / t["verify_steps"] for s, t in rows) / sum(s * s for s, _ in rows)
    fixed = sum((t["wall_s"] - t["draft_s"]) / t["verify_steps"] for _, t in rows) / len(rows)
    return fixed, per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tau", required=True, type=Path, nargs="+", help="e2e_bench.py JSONs whose τ per shape is used")
    parser.add_argument("--gpu", required=True, type=Path, help="e2e_bench.py JSON from the GPU, with spec=off")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gpu, measured = totals(args.gpu), totals(*args.tau)
    if "off" not in gpu:
        raise SystemExit(f"{args.gpu} has no spec=off rows")
    base, per_step = fit_step(gpu)
    off = gpu["off"]["tokens"] / gpu["off"]["wall_s"]
    print(f"GPU step = {base * 1e3:.3f} ms (verify, host, prefill) + {per_step * 1e3:.3f} ms x draft steps; "
          f"spec=off {off:.1f} tok/s")
    rows = []
    for method, t in measured.items():
        if method == "off":
            continue
        steps, tau = parse_spec(method).steps, t["tokens"] / t["verify_steps"]
        predicted = tau / (base + per_step * steps)
        row = {"spec": method, "steps": steps, "tau": tau, "predicted_tok_per_s": predicted,
               "predicted_speedup": predicted / off}
        if method in gpu:
            row["gpu_tau"] = gpu[method]["tokens"] / gpu[method]["verify_steps"]
            row["gpu_tok_per_s"] = gpu[method]["tokens"] / gpu[method]["wall_s"]
        rows.append(row)
    for row in sorted(rows, key=lambda r: -r["predicted_tok_per_s"]):
        seen = f"  (GPU: τ {row['gpu_tau']:.2f}, {row['gpu_tok_per_s']:.1f} tok/s)" if "gpu_tau" in row else ""
        print(f"{row['spec']:>10}: τ {row['tau']:.2f} -> {row['predicted_tok_per_s']:7.1f} tok/s "
              f"({row['predicted_speedup']:.2f}x){seen}")
    if args.json:
        args.json.write_text(json.dumps({"args": {"tau": list(map(str, args.tau)), "gpu": str(args.gpu)},
                                         "base_s": base, "per_step_s": per_step, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
