"""Which speculative shape at which concurrency: a bench sweep over spec shapes x bench.batch_size
read per batch size.

Per (engine, suite, max tokens, drafter) and batch size: the fastest shape and its ratio to spec=off
measured at that batch size, and the shape to run there (the fastest only when it beat spec=off:
by its whole min-max range when the jobs carry one, else by its median). A plot draws speedup
against batch size, one line per shape. The schedule lists the shape to run at each batch size
with the launch flags that give it in SGLang (`--speculative-*`, `--max-running-requests`) and vLLM
(`--speculative-config`, `--max-num-seqs`; vLLM drafts chains, so its entry is the best chain); the
bench writes it as a sweep artifact and beside the drafter's export.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.bench.costmodel import fit_step_cost
from eagle3.engine.schedule import SCHEDULE_FILE


def load_groups(results: list[dict]) -> dict[tuple, dict[int, list[dict]]]:
    """Successful jobs per (engine, suite, max tokens, drafter), then per batch size."""
    out: dict[tuple, dict[int, list[dict]]] = {}
    for r in results:
        if r.get("status") != "ok":
            continue
        key = (r["engine"], r["suite"], r["max_new_tokens"], drafter_key(r))
        out.setdefault(key, {}).setdefault(int(r["batch_size"]), []).append(r)
    return out


def drafter_key(result: dict) -> str:
    return str(result.get("drafter_hash") or result.get("drafter") or "")


def beats_off(job: dict) -> bool:
    """Faster than spec=off beyond noise: the whole speedup range above 1 when measured, else the
    median above 1."""
    return job.get("speedup_min", job["speedup"]) > 1.0


def choose(jobs: list[dict], chains_only: bool = False) -> tuple[dict | None, dict | None]:
    """(the fastest speculative job, the job to run: that one when it beat spec=off, else None)."""
    shapes = [j for j in jobs if j["spec"] != "off" and (j["topk"] == 1 or not chains_only)]
    if not shapes:
        return None, None
    fastest = max(shapes, key=lambda j: j["speedup"])
    return fastest, fastest if beats_off(fastest) else None


def per_batch_rows(results: list[dict]) -> list[dict]:
    """One row per group and batch size: spec=off's tok/s, the fastest shape, its ratio, the choice."""
    rows = []
    for (engine, suite, _, drafter), by_batch in sorted(load_groups(results).items()):
        for batch, jobs in sorted(by_batch.items()):
            fastest, chosen = choose(jobs)
            if fastest is None:
                continue
            rows.append(
                {
                    "engine": engine,
                    "suite": suite,
                    "batch_size": batch,
                    "spec_off_tok_s": round(fastest["baseline_tokens_per_s"], 2),
                    "fastest": fastest["spec"],
                    "fastest_tok_s": round(fastest["tokens_per_s"], 2),
                    "speedup": round(fastest["speedup"], 3),
                    "speedup_range": speedup_range(fastest),
                    "run": chosen["spec"] if chosen else "off",
                    "drafter": drafter,
                }
            )
    return rows


def speedup_range(job: dict) -> str:
    if "speedup_min" not in job:
        return ""
    return f"{job['speedup_min']:.2f}-{job['speedup_max']:.2f}"


# ---------------------------------------------------------------- the schedule


def schedule(results: list[dict]) -> list[dict]:
    """Per (engine, suite, max tokens, drafter): the hardware and engine version measured on, the
    shape to run at each measured batch size and the SGLang and vLLM flags for it."""
    out = []
    for (engine, suite, max_tokens, drafter), by_batch in sorted(load_groups(results).items()):
        entries = []
        for batch, jobs in sorted(by_batch.items()):
            fastest, chosen = choose(jobs)
            if fastest is None:
                continue
            _, chain = choose(jobs, chains_only=True)
            drafter_path = fastest.get("drafter") or "DRAFTER"
            entries.append(
                {
                    "batch_size": batch,
                    "spec": shape(chosen),
                    "speedup": round(chosen["speedup"], 4) if chosen else 1.0,
                    "fastest": shape(fastest),
                    "fastest_speedup": round(fastest["speedup"], 4),
                    "sglang_args": sglang_flags(chosen, batch, drafter_path),
                    "vllm_chain": shape(chain),
                    "vllm_args": vllm_flags(chain, batch, drafter_path),
                }
            )
        if entries:
            measured = next(iter(by_batch.values()))[0]  # one sweep: one machine and engine
            out.append(
                {
                    "engine": engine,
                    "suite": suite,
                    "max_new_tokens": max_tokens,
                    "drafter": drafter,
                    "hardware": measured.get("hardware"),
                    "engine_version": measured.get("engine_version"),
                    "entries": entries,
                }
            )
    return out


def shape(job: dict | None) -> dict:
    if job is None:
        return {"label": "off", "depth": 1, "steps": 0, "topk": 1}
    return {"label": job["spec"], "depth": job["depth"], "steps": job["steps"], "topk": job["topk"]}


def sglang_flags(job: dict | None, batch: int, drafter: str) -> list[str]:
    """`python -m sglang.launch_server` flags for this shape at `batch` concurrent requests."""
    flags = ["--max-running-requests", str(batch)]
    if job is None:
        return flags
    return flags + [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(drafter),
        "--speculative-num-steps",
        str(job["steps"]),
        "--speculative-eagle-topk",
        str(job["topk"]),
        "--speculative-num-draft-tokens",
        str(job["depth"]),
    ]


def vllm_flags(job: dict | None, batch: int, drafter: str) -> list[str]:
    """vLLM server flags for this chain at `batch` concurrent sequences."""
    flags = ["--max-num-seqs", str(batch)]
    if job is None:
        return flags
    config = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": job["steps"]}
    return flags + ["--speculative-config", json.dumps(config)]


def write_schedule(results: list[dict], out_dir: Path) -> list[Path]:
    """schedule.json in out_dir and, for each drafter export on this machine, beside it
    (<export>/schedule.json, next to its sglang/ and vllm/ folders)."""
    plan = schedule(results)
    if not plan:
        return []
    text = json.dumps(plan, indent=1)
    path = out_dir / SCHEDULE_FILE
    path.write_text(text)
    written = [path]
    for folder in {Path(r["drafter"]).parent for r in results if r.get("drafter")}:
        if folder.is_dir():
            (folder / SCHEDULE_FILE).write_text(text)
    return written


def schedule_lines(results: list[dict]) -> list[str]:
    """The per-batch choice in words: fastest shape, its ratio, what to run."""
    lines = []
    for row in per_batch_rows(results):
        spread = f" ({row['speedup_range']}x)" if row["speedup_range"] else ""
        run = row["run"] if row["run"] != "off" else "spec=off (no shape beat it)"
        lines.append(
            f"{row['engine']}, {row['suite']}, batch {row['batch_size']}: fastest {row['fastest']} "
            f"at {row['speedup']:.2f}x spec=off{spread}; run {run}"
        )
    return lines


def write_load_plot(results: list[dict], out_dir: Path) -> Path | None:
    """speedup_by_batch.png: speedup over spec=off against batch size, one line per shape (and
    engine, suite), when the sweep measured more than one batch size."""
    groups = load_groups(results)
    if not any(len(by_batch) > 1 for by_batch in groups.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (engine, suite, _, _), by_batch in sorted(groups.items()):
        labels = sorted(
            {j["spec"] for jobs in by_batch.values() for j in jobs if j["spec"] != "off"}
        )
        for label in labels:
            points = sorted(
                (batch, j["speedup"])
                for batch, jobs in by_batch.items()
                for j in jobs
                if j["spec"] == label
            )
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=f"{engine} {label} ({suite})")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests (bench.batch_size)")
    ax.set_ylabel("speedup over spec=off at that batch size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "speedup_by_batch.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def step_cost_rows(results: list[dict]) -> list[dict]:
    """Per group and batch size: every measured shape's seconds per step (spec=off's included) and
    the cost model's line through the chains, step(D) = verify + draft_step * (D - 1)
    (eagle3.bench.costmodel), which predicts the depths not measured at that batch size."""
    rows = []
    for (engine, suite, _, _), by_batch in sorted(load_groups(results).items()):
        for batch, jobs in sorted(by_batch.items()):
            shapes = [j for j in jobs if j["spec"] != "off" and j.get("step_s")]
            if not shapes:
                continue
            base = shapes[0]["baseline_step_s"]
            chains = [(1, base)] + [(j["depth"], j["step_s"]) for j in shapes if j["topk"] == 1]
            cost = fit_step_cost(chains)
            row = {
                "engine": engine,
                "suite": suite,
                "batch_size": batch,
                "off_step_ms": round(1000 * base, 3),
                "shapes_step_ms": ", ".join(
                    f"{j['spec']} {1000 * j['step_s']:.3f}" for j in sorted(shapes, key=_depth)
                ),
                "verify_ms": round(1000 * cost.verify_s, 3) if cost else "",
                "per_depth_ms": round(1000 * cost.draft_step_s, 3) if cost else "",
            }
            rows.append(row)
    return rows


def _depth(job: dict) -> tuple:
    return (job["depth"], job["topk"])


def markdown_table(rows: list[dict]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_load_summary(results: list[dict], out_dir: Path) -> list[Path]:
    """load.md (per batch size: the fastest shape, its ratio, what to run; step costs per batch
    size), schedule.json (and beside the drafter) and speedup_by_batch.png; prints load.md."""
    rows = per_batch_rows(results)
    if not rows:
        return []
    text = "## Per concurrency\n\n" + markdown_table(rows)
    costs = step_cost_rows(results)
    if costs:
        text += "\n## Step cost per batch size\n\n" + markdown_table(costs)
    path = out_dir / "load.md"
    path.write_text(text + "\n" + "\n".join(schedule_lines(results)) + "\n")
    print(path.read_text())
    files = [path, *write_schedule(results, out_dir)]
    plot = write_load_plot(results, out_dir)
    return files + ([plot] if plot else [])
