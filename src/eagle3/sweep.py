"""The bench sweep around Hydra multirun: a parent MLflow run per sweep (a Hydra callback
registered in conf/hydra), then a summary of the jobs' results: markdown + CSV table, plots of
tok/s and tau against depth per engine and batch size, the cost model, the best config.

The callback acts only for `python -m eagle3.bench`; other apps' sweeps pass through.
"""

from __future__ import annotations

import atexit
import csv
import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from eagle3 import tracking
from eagle3.costmodel import fit_step_cost, predict
from eagle3.lifecycle import process_identity
from eagle3.redact import mask_argv

PARENT_FILE = "bench_parent_run.json"
BENCH_JOB = "bench"
COLUMNS = (
    "engine",
    "spec",
    "depth",
    "steps",
    "topk",
    "batch_size",
    "suite",
    "status",
    "tokens_per_s",
    "baseline_tokens_per_s",
    "speedup",
    "accept_length",
    "ttft_p50_ms",
    "itl_p50_ms",
    "error",
)


def parent_run_id(sweep_dir: Path) -> str | None:
    path = sweep_dir / PARENT_FILE
    return json.loads(path.read_text())["run_id"] if path.exists() else None


class BenchSweepCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.job.name != BENCH_JOB or not config.tracking.enabled:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        client = tracking.client(config)
        experiment_id = tracking.setup(config)
        run = client.create_run(
            experiment_id,
            run_name=f"sweep {sweep_dir.parent.name}/{sweep_dir.name}",
            tags={
                "stage": "bench-sweep",
                "sweep_dir": str(sweep_dir),
                "overrides": " ".join(mask_argv(list(config.hydra.overrides.task))),
                **process_identity(),
            },
        )
        (sweep_dir / PARENT_FILE).write_text(json.dumps({"run_id": run.info.run_id}))
        atexit.register(_kill_if_running, client, run.info.run_id)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.job.name != BENCH_JOB:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        results = [
            json.loads(p.read_text())
            for p in sorted(
                sweep_dir.glob("*/bench_result.json"), key=lambda p: _job_number(p.parent.name)
            )
        ]
        summarize(config, results, sweep_dir, parent_run_id(sweep_dir))
        if results and all(r.get("status") != "ok" for r in results):
            # partial failures leave the exit status 0 (the summary lists them); none succeeding is an error
            print(
                f"eagle3 error: all {len(results)} bench jobs failed; first: {results[0].get('error')}",
                file=sys.stderr,
            )
            sys.exit(1)


def _kill_if_running(client, run_id: str) -> None:
    """At exit: a parent run the sweep did not finish (interrupted, stopped) is marked KILLED."""
    if client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id, "KILLED")


def _job_number(name: str) -> int:
    return int(name) if name.isdigit() else 1 << 30


# ---------------------------------------------------------------- the summary


def summarize(
    cfg: DictConfig, results: list[dict], out_dir: Path, run_id: str | None = None
) -> dict:
    """Write summary.md / summary.csv / plots / cost_model.md into out_dir, log them to the parent
    run, print the table and the best config; returns {"best": result | None, "files": [...]}."""
    rows = [{c: _cell(r.get(c)) for c in COLUMNS} for r in results]
    files = [write_markdown(rows, out_dir / "summary.md"), write_csv(rows, out_dir / "summary.csv")]
    files += write_plots(results, out_dir)
    model_rows = cost_model_rows(results, list(cfg.bench.cost_model_depths))
    files.append(
        write_markdown(
            model_rows,
            out_dir / "cost_model.md",
            ("engine", "suite", "batch_size", "depth", "predicted_tok_s", "measured_tok_s"),
        )
    )
    ok = [r for r in results if r.get("status") == "ok"]
    best = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
    print((out_dir / "summary.md").read_text())
    if model_rows:
        print(
            "cost model (decode tok/s, predicted vs measured):\n"
            + (out_dir / "cost_model.md").read_text()
        )
    failed = [r for r in results if r.get("status") != "ok"]
    if best:
        print(
            f"best: serve={best['engine']} spec {best['spec']} (depth {best['depth']}, steps {best['steps']}, "
            f"topk {best['topk']}) batch {best['batch_size']}: {best['tokens_per_s']:.1f} tok/s, "
            f"speedup {best['speedup']:.2f}x, tau {best['accept_length']:.2f}"
        )
    if failed:
        print(
            f"{len(failed)} of {len(results)} jobs failed: "
            + "; ".join(f"{r['engine']} {r['spec']}: {r.get('error', '?')[:200]}" for r in failed)
        )
    if run_id:
        log_to_parent(cfg, run_id, files, best, len(failed))
    return {"best": best, "files": files}


def _cell(value):
    if isinstance(value, float):
        return round(value, 4)
    return "" if value is None else value


def write_markdown(rows: list[dict], path: Path, columns=COLUMNS) -> Path:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append(
            "| "
            + " | ".join(
                str(row.get(c, "")).replace("|", "/").replace("\n", " ")[:120] for c in columns
            )
            + " |"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def write_csv(rows: list[dict], path: Path) -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return path


def groups(results: list[dict]) -> dict[tuple, list[dict]]:
    """Successful jobs per (engine, suite, batch size, max tokens)."""
    out: dict[tuple, list[dict]] = {}
    for r in results:
        if r.get("status") == "ok":
            out.setdefault(
                (r["engine"], r["suite"], r["batch_size"], r["max_new_tokens"]), []
            ).append(r)
    return out


def write_plots(results: list[dict], out_dir: Path) -> list[Path]:
    """tokens_per_s.png and accept_length.png: one line per (engine, batch size), depth on x;
    the baseline is depth 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for metric, label in (
        ("tokens_per_s", "output tok/s"),
        ("accept_length", "accept length (tau)"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for (engine, suite, batch, _), jobs in sorted(groups(results).items()):
            points = sorted(
                {(1, jobs[0]["baseline_tokens_per_s"] if metric == "tokens_per_s" else 1.0)}
                | {
                    (r["depth"] if r["spec"] != "off" else 1, r[metric])
                    for r in jobs
                    if r["topk"] == 1
                }
            )
            if points:
                ax.plot(*zip(*points), marker="o", label=f"{engine} bs{batch} ({suite})")
            trees = [(r["depth"], r[metric]) for r in jobs if r["topk"] > 1]
            if trees:
                ax.scatter(*zip(*trees), marker="^", label=f"{engine} bs{batch} trees")
        ax.set_xlabel("depth (tokens verified per step)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{metric}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def cost_model_rows(results: list[dict], depths: list[int]) -> list[dict]:
    """Per group: fit step cost on (depth, step time) incl. the baseline, per-position acceptance
    from the deepest chain; predicted decode tok/s for the configured and measured depths."""
    rows = []
    for (engine, suite, batch, _), jobs in sorted(groups(results).items()):
        chains = [r for r in jobs if r["topk"] == 1 and r["spec"] != "off"]
        with_pos = [r for r in chains if r.get("accept_per_pos")]
        if not with_pos:
            continue
        points = [(1, chains[0]["baseline_step_s"])] + [(r["depth"], r["step_s"]) for r in chains]
        cost = fit_step_cost(points)
        if cost is None:
            continue
        per_pos = max(with_pos, key=lambda r: len(r["accept_per_pos"]))["accept_per_pos"]
        measured = {r["depth"]: r["decode_tokens_per_s"] for r in chains}
        predicted = predict(per_pos, cost, sorted(set(depths) | set(measured)))
        for depth, tok_s in sorted(predicted.items()):
            rows.append(
                {
                    "engine": engine,
                    "suite": suite,
                    "batch_size": batch,
                    "depth": depth,
                    "predicted_tok_s": round(tok_s, 2),
                    "measured_tok_s": round(measured[depth], 2) if depth in measured else "",
                }
            )
    return rows


def log_to_parent(
    cfg: DictConfig, run_id: str, files: list[Path], best: dict | None, failed: int
) -> None:
    client = tracking.client(cfg)
    for path in files:
        client.log_artifact(run_id, str(path))
    client.set_tag(run_id, "failed_jobs", str(failed))
    if best:
        client.set_tag(run_id, "best", f"{best['engine']} {best['spec']} bs{best['batch_size']}")
        client.log_metric(run_id, "best_tokens_per_s", best["tokens_per_s"])
        client.log_metric(run_id, "best_speedup", best["speedup"])
    client.set_terminated(run_id, "FINISHED")
