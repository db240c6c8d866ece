"""The bench sweep around Hydra multirun: a parent MLflow run per sweep (a Hydra callback
registered in conf/hydra), then a summary of the jobs' results: markdown + CSV table (medians of
bench.repeats passes with their ranges), plots of tok/s, speedup and tau against depth per engine
and batch size, the cost model, and a verdict (eagle3.bench.verdict) that names a winner only when it
beat spec=off beyond noise.

The callback acts only for `python -m eagle3.bench`; other apps' sweeps pass through.
"""

from __future__ import annotations

import atexit
import csv
import json
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from eagle3.bench.concurrency import write_load_summary
from eagle3.bench.costmodel import fit_step_cost, predict
from eagle3.bench.verdict import Rules, against_off, baseline_row, verdict_lines, winner
from eagle3.core import tracking
from eagle3.core.common import check_group_choices
from eagle3.core.config import BenchConfig
from eagle3.core.lifecycle import process_identity, watch_runs
from eagle3.core.redact import mask_argv

PARENT_FILE = "bench_parent_run.json"
JOBS_FILE = "bench_jobs.json"  # how many jobs the sweep runs (for the time-left estimate)
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
    "repeats",
    "tokens_per_s",
    "tokens_per_s_min",
    "tokens_per_s_max",
    "baseline_tokens_per_s",
    "baseline_tokens_per_s_min",
    "baseline_tokens_per_s_max",
    "speedup",
    "speedup_min",
    "speedup_max",
    "vs_spec_off",
    "accept_length",
    "drafter_hash",
    "ttft_p50_ms",
    "itl_p50_ms",
    "hardware",
    "engine_version",
    "torch_version",
    "dtype",
    "temperature",
    "git_commit",
    "error",
)


def parent_run_id(sweep_dir: Path) -> str | None:
    path = sweep_dir / PARENT_FILE
    return json.loads(path.read_text())["run_id"] if path.exists() else None


class BenchSweepCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.job.name != BENCH_JOB:
            return
        check_group_choices(list(config.hydra.overrides.task))
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / JOBS_FILE).write_text(json.dumps({"jobs": job_count(config.hydra)}))
        if not config.tracking.enabled:
            return
        client = tracking.client(config.tracking)
        experiment_id = tracking.setup(config.tracking)
        watch_runs(config.tracking.uri, experiment_id, config.tracking.watchdog_poll_s)
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
        summary = summarize(config.bench, results, sweep_dir)
        failed = [r for r in results if r.get("status") != "ok"]
        run_id = parent_run_id(sweep_dir)
        if run_id:
            client = tracking.client(config.tracking)
            log_to_parent(client, run_id, summary, len(failed))
        if failed:  # the summary lists every job; the exit status says not all were measured
            print(failed_jobs_report(failed, len(results)), file=sys.stderr)
            sys.exit(1)


def job_count(hydra_cfg) -> int | None:
    """The jobs a sweep runs: the search's n_trials, else the grid's size (None if unknown)."""
    if hydra_cfg.sweeper.get("n_trials"):
        return int(hydra_cfg.sweeper.n_trials)
    count = 1
    try:
        for override in OverridesParser.create().parse_overrides(list(hydra_cfg.overrides.task)):
            if override.is_sweep_override():
                count *= len(list(override.sweep_string_iterator()))
    except Exception:  # a sweep syntax without a finite list (an interval): no estimate
        return None
    return count


def progress_line(sweep_dir: Path) -> str:
    """Which job of how many is starting and, from the jobs done so far, about how long the sweep
    has left (the first job also measured spec=off: the estimate errs long)."""
    jobs = sweep_dir / JOBS_FILE
    total = json.loads(jobs.read_text())["jobs"] if jobs.exists() else None
    done = len(list(sweep_dir.glob("*/bench_result.json")))
    line = f"bench job {done + 1}" + (f" of {total}" if total else "")
    started = [p.stat().st_mtime for p in sweep_dir.glob("*/.hydra/config.yaml")]
    if not done or not total or not started:
        return line
    elapsed = time.time() - min(started)
    left = elapsed / done * max(total - done, 0)
    return f"{line}; {done} done in {elapsed:.0f} s, about {left:.0f} s left"


def failed_jobs_report(failed: list[dict], jobs: int) -> str:
    """One line per failed job: its number in the sweep, its shape and its error."""
    head = (
        f"all {jobs} bench jobs failed"
        if len(failed) == jobs
        else f"{len(failed)} of {jobs} bench jobs failed"
    )
    lines = [
        f"  job {Path(r.get('folder', '?')).name} ({r.get('engine')} {r.get('spec')} "
        f"bs{r.get('batch_size')}): {r.get('error')}"
        for r in failed
    ]
    return "\n".join([f"eagle3 error: {head}; the summary lists them", *lines])


def _kill_if_running(client, run_id: str) -> None:
    """At exit: a parent run the sweep did not finish (interrupted, stopped) is marked KILLED."""
    if client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id, "KILLED")


def _job_number(name: str) -> int:
    return int(name) if name.isdigit() else 1 << 30


# ---------------------------------------------------------------- the summary


def summarize(bench: BenchConfig, results: list[dict], out_dir: Path) -> dict:
    """Write summary.md / summary.csv / plots / cost_model.md / verdict.txt into out_dir, print the
    table and the verdict; returns {"best": the winning job, or None when no shape beat spec=off
    beyond noise, "verdict": [lines], "files": [...]} (a sweep logs them to its parent run)."""
    for r in results:
        if r.get("status") == "ok":
            r["vs_spec_off"] = against_off(r, baseline_row([r]))
    rows = [{c: _cell(r.get(c)) for c in COLUMNS} for r in results]
    files = [write_markdown(rows, out_dir / "summary.md"), write_csv(rows, out_dir / "summary.csv")]
    files += write_plots(results, out_dir)
    model_rows = cost_model_rows(results, list(bench.cost_model_depths))
    files.append(
        write_markdown(
            model_rows,
            out_dir / "cost_model.md",
            (
                "engine",
                "suite",
                "batch_size",
                "drafter",
                "depth",
                "predicted_tok_s",
                "measured_tok_s",
            ),
        )
    )
    files += write_load_summary(results, out_dir)
    print((out_dir / "summary.md").read_text())
    if model_rows:
        print(
            "cost model (decode tok/s, predicted vs measured):\n"
            + (out_dir / "cost_model.md").read_text()
        )
    failed = [r for r in results if r.get("status") != "ok"]
    if failed:
        print(
            f"{len(failed)} of {len(results)} jobs failed: "
            + "; ".join(f"{r['engine']} {r['spec']}: {r.get('error', '?')[:200]}" for r in failed)
        )
    verdict, winners = [], []
    for key, jobs in sorted(groups(results).items()):
        engine, suite, batch, max_tokens, drafter = key
        named = f", drafter {drafter}" if drafter else ""
        verdict.append(f"{engine}, {suite}, batch {batch}, {max_tokens} new tokens{named}:")
        rules = Rules.of(bench)
        verdict += verdict_lines(jobs, [m for m in model_rows if _model_key(m) == key], rules)
        chosen = winner(jobs, rules)[0]
        if chosen["spec"] != "off":
            winners.append(chosen)
    files.append(out_dir / "verdict.txt")
    files[-1].write_text("\n".join(verdict) + "\n")
    print("\n".join(verdict))
    best = max(winners, key=lambda r: r["speedup"]) if winners else None
    return {"best": best, "verdict": verdict, "files": files}


def _model_key(row: dict) -> tuple:
    return (row["engine"], row["suite"], row["batch_size"], row["max_new_tokens"], row["drafter"])


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
    """Successful speculative jobs per (engine, suite, batch size, max tokens, drafter); each
    group's spec=off is the baseline its jobs report."""
    out: dict[tuple, list[dict]] = {}
    for r in results:
        if r.get("status") == "ok" and r["spec"] != "off":
            key = (r["engine"], r["suite"], r["batch_size"], r["max_new_tokens"])
            out.setdefault((*key, r.get("drafter_hash") or ""), []).append(r)
    return out


def write_plots(results: list[dict], out_dir: Path) -> list[Path]:
    """tokens_per_s.png, speedup.png and accept_length.png: one line per (engine, batch size),
    depth on x (spec=off is depth 1), the median of the repeats with a bar over their range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for metric, label in (
        ("tokens_per_s", "output tok/s (median, min-max bar)"),
        ("speedup", "speedup over spec=off (median, min-max bar)"),
        ("accept_length", "accept length (tau)"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for (engine, suite, batch, _, drafter), jobs in sorted(groups(results).items()):
            rows = [baseline_row(jobs), *jobs]
            for name, marker, chosen in (
                ("", "o", [r for r in rows if r["topk"] == 1]),
                (" trees", "^", [r for r in rows if r["topk"] > 1]),
            ):
                chosen = sorted(chosen, key=lambda r: r["depth"])
                if chosen:
                    label = f"{engine} bs{batch} {drafter} ({suite}){name}"
                    _errorbar(ax, chosen, metric, marker, label)
        if metric == "speedup":
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
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


def _errorbar(ax, rows: list[dict], metric: str, marker: str, label: str) -> None:
    xs = [r["depth"] for r in rows]
    ys = [r[metric] for r in rows]
    low = [y - r.get(f"{metric}_min", y) for r, y in zip(rows, ys)]
    high = [r.get(f"{metric}_max", y) - y for r, y in zip(rows, ys)]
    line = "-" if marker == "o" else "none"
    ax.errorbar(xs, ys, yerr=[low, high], marker=marker, linestyle=line, capsize=3, label=label)


def cost_model_rows(results: list[dict], depths: list[int]) -> list[dict]:
    """Per group: fit step cost on (depth, step time) incl. the baseline, per-position acceptance
    from the deepest chain; predicted decode tok/s for the configured and measured depths."""
    rows = []
    for (engine, suite, batch, max_tokens, drafter), jobs in sorted(groups(results).items()):
        chains = [r for r in jobs if r["topk"] == 1]
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
                    "max_new_tokens": max_tokens,
                    "drafter": drafter,
                    "depth": depth,
                    "predicted_tok_s": round(tok_s, 2),
                    "measured_tok_s": round(measured[depth], 2) if depth in measured else "",
                }
            )
    return rows


def log_to_parent(client, run_id: str, summary: dict, failed: int) -> None:
    """A sweep's summary (summarize) on its parent run, which it ends."""
    files, best, verdict = summary["files"], summary["best"], summary["verdict"]
    for path in files:
        client.log_artifact(run_id, str(path))
    client.set_tag(run_id, "failed_jobs", str(failed))
    client.set_tag(run_id, "verdict", "\n".join(verdict)[:5000])
    client.set_tag(
        run_id,
        "winner",
        f"{best['engine']} {best['spec']} bs{best['batch_size']}" if best else "spec=off",
    )
    if best:
        client.log_metric(run_id, "winner_tokens_per_s", best["tokens_per_s"])
        client.log_metric(run_id, "winner_speedup", best["speedup"])
    client.set_terminated(run_id, "FINISHED")
