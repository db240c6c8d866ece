"""`python -m eagle3.tools.results`: measured result folders (results/<run>/) as MLflow runs, and the
all-suite totals of bench files.

    python -m eagle3.tools.results import results/smollm2-135m_h200_2026-11-30 [hydra overrides]
    python -m eagle3.tools.results totals e2e.json [e2e_deeper.json ...] [--json totals.json]

`import` brings a GPU machine's results into the MLflow store, so the UI shows them beside local runs.

GPU machines without network run the stages with tracking off (no mlflow there); what comes back is
a folder of JSON and log files (results/<run>/: e2e.json or e2e_<variant>.json from the
engine-loop benchmark that preceded `python -m eagle3.bench serve.inprocess=true`, one engine setting
per file, the run names ending with the variant; engine_*.json from bench_engine.py; *_progress.log from the train stage's progress and validation lines,
*_manifest.json from the stage outputs, gpu.txt, *.png plots made from them). This logs one parent
run named after the folder, with the plots as its artifacts, and a child run per bench row, per
method over all suites of an e2e file ("all <method>", as `totals` sums them: the headline figures),
engine-step row, training and DDP run.

Importing a folder again replaces its earlier import (runs tagged import_source=<folder name>).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from mlflow.tracking import MlflowClient

from eagle3.core.common import compose
from eagle3.core.tracking import flatten, setup
from eagle3.tools.totals import report, totals

PROGRESS = re.compile(
    r"train: step (\d+)/\d+ epoch \d+ loss ([\d.]+) tau_hat ([\d.]+)\s+([\d.]+) samples/s"
)
VALIDATION = re.compile(
    r"train: validation after epoch \d+ \(step (\d+)\): tau_hat ([\d.]+)"
    r"(?:, over the first \d+ tokens ([\d.]+))?, loss ([\d.]+)"
)


def progress_rows(path: Path) -> list[dict]:
    """The train stage's progress lines (step, loss, tau_hat, samples/s of the window) and validation
    lines (val/tau_hat, val/tau_hat_head, val/loss at their step). A run resumed after a kill repeats
    the steps since its last checkpoint: the later line of a step wins."""
    train, val = {}, {}
    for line in path.read_text().splitlines():
        if m := PROGRESS.search(line):
            train[int(m[1])] = {
                "step": int(m[1]),
                "train/loss": float(m[2]),
                "train/tau_hat": float(m[3]),
                "train/samples_per_s": float(m[4]),
            }
        elif m := VALIDATION.search(line):
            head = {"val/tau_hat_head": float(m[3])} if m[3] else {}
            val[int(m[1])] = {
                "step": int(m[1]),
                "val/tau_hat": float(m[2]),
                **head,
                "val/loss": float(m[4]),
            }
    return [train[step] for step in sorted(train)] + [val[step] for step in sorted(val)]


def e2e_runs(data: dict) -> list[tuple[str, dict, dict, dict]]:
    """(name, params, metrics, per-position curve) per suite x method; speedup against spec=off."""
    off = {r["suite"]: r["tok_per_s"] for r in data["rows"] if r["method"] == "off"}
    runs = []
    for row in data["rows"]:
        metrics = {
            k: float(row[k])
            for k in (
                "tok_per_s",
                "tau",
                "wall_s",
                "tokens",
                "match_hf",
                "draft_ms_per_step",
                "verify_ms_per_step",
                "host_ms_per_step",
                "prefill_ms_per_prompt",
            )
            if k in row
        }
        if row["suite"] in off:
            metrics["speedup_vs_off"] = row["tok_per_s"] / off[row["suite"]]
        params = {
            "bench.suite": row["suite"],
            "method": row["method"],
            "prompts": row["prompts"],
            "max_new_tokens": data["args"]["max_new_tokens"],
            "dtype": data["args"]["dtype"],
        }
        runs.append(
            (
                f"{row['suite']} {row['method']}",
                params,
                metrics,
                row.get("acceptance_per_position", []),
            )
        )
    return runs


def all_suites_runs(data: dict, off_rows: list[dict]) -> list[tuple[str, dict, dict, dict]]:
    """(name, params, metrics, no curve) per method with its suites summed (python -m eagle3.tools.results totals): the headline
    figures. A file without spec=off rows (a variant of the same run) borrows off_rows."""
    own_off = any(r["method"] == "off" for r in data["rows"])
    runs = []
    for total in totals(data["rows"] + ([] if own_off else off_rows)):
        if total["method"] == "off" and not own_off:
            continue
        metrics = {
            k: float(total[k])
            for k in (
                "tok_per_s",
                "tau",
                "wall_s",
                "tokens",
                "step_ms",
                "draft_ms_per_step",
                "verify_ms_per_step",
                "prefill_ms_per_prompt",
            )
            if k in total
        }
        if "speedup" in total:
            metrics["speedup_vs_off"] = total["speedup"]
        params = {
            "bench.suite": "all",
            "suites": ",".join(total["suites"]),
            "method": total["method"],
            "prompts": total["prompts"],
            "max_new_tokens": data["args"]["max_new_tokens"],
            "dtype": data["args"]["dtype"],
            "off_from": "this file" if own_off else "e2e.json",
        }
        runs.append((f"all {total['method']}", params, metrics, []))
    return runs


def engine_runs(data: dict, path_name: str) -> list[tuple[str, dict, dict, dict]]:
    runs = []
    for row in data["rows"]:
        metrics = {
            k: float(row[k])
            for k in (
                "tok_per_s",
                "step_ms",
                "draft_ms_per_step",
                "verify_ms_per_step",
                "prefill_ms_per_request",
                "capture_s",
            )
            if k in row
        }
        metrics.update(
            {f"projected_tok_per_s_tau{t}": v for t, v in row["projected_tok_per_s"].items()}
        )
        params = {
            "spec": row["spec"],
            "engine_path": path_name,
            "weights": "random (SmolLM2 shapes)",
        }
        runs.append((f"engine-step {row['spec']} {path_name}", params, metrics, []))
    return runs


def log_child(
    mlflow,
    parent,
    name: str,
    params: dict,
    metrics: dict,
    curve=(),
    steps=(),
    tags=None,
    curve_name: str = "acceptance_per_position",
):
    inherited = {k: v for k, v in parent.data.tags.items() if not k.startswith("mlflow.")}
    run = mlflow.create_run(
        parent.info.experiment_id,
        run_name=name,
        tags={**inherited, "mlflow.parentRunId": parent.info.run_id, **(tags or {})},
    )
    run_id = run.info.run_id
    for key, value in params.items():
        mlflow.log_param(run_id, key, str(value)[:500])
    for key, value in metrics.items():
        mlflow.log_metric(run_id, key, value)
    for position, rate in enumerate(curve):
        mlflow.log_metric(run_id, curve_name, rate, step=position)
    for row in steps:
        for key, value in row.items():
            if key != "step":
                mlflow.log_metric(run_id, key, value, step=row["step"])
    mlflow.set_terminated(run_id)
    return run_id


def replace_earlier(mlflow, experiment_id: str, source: str) -> int:
    old = mlflow.search_runs(
        [experiment_id], f"tags.import_source = '{source}'", max_results=10_000
    )
    for run in old:
        mlflow.delete_run(run.info.run_id)
    return len(old)


def import_folder(folder: Path, overrides: list[str]) -> dict:
    cfg = compose(overrides)
    experiment_id = setup(cfg.tracking)
    mlflow = MlflowClient(tracking_uri=cfg.tracking.uri)
    replaced = replace_earlier(mlflow, experiment_id, folder.name)
    parent = mlflow.create_run(experiment_id, run_name=folder.name, tags=folder_tags(folder))
    children = (
        train_children(mlflow, parent, folder)
        + ddp_children(mlflow, parent, folder)
        + bench_children(mlflow, parent, folder)
        + engine_children(mlflow, parent, folder)
    )
    for picture in sorted(folder.glob("*.png")):  # plots made from the folder's files
        mlflow.log_artifact(parent.info.run_id, str(picture))
    mlflow.set_terminated(parent.info.run_id)
    return {
        "parent": parent.info.run_id,
        "children": len(children),
        "replaced": replaced,
        "uri": cfg.tracking.uri,
    }


def folder_tags(folder: Path) -> dict:
    gpu = folder / "gpu.txt"
    machine = gpu.read_text().splitlines()[1:] if gpu.exists() else []
    return {
        "import_source": folder.name,
        "stage": "import",
        "machine": ", ".join(machine) or "unknown",
    }


def train_children(mlflow, parent, folder: Path) -> list:
    """The training run of train_manifest.json, with its progress log's steps."""
    if not (folder / "train_manifest.json").exists():
        return []
    manifest = json.loads((folder / "train_manifest.json").read_text())
    counts = {
        f"final/{k}": float(v) for k, v in manifest["counts"].items() if isinstance(v, (int, float))
    }
    params = flatten({k: manifest["config"][k] for k in ("train", "drafter")})
    progress = folder / "train_progress.log"
    steps = progress_rows(progress) if progress.exists() else []
    val_acc = [a for a in manifest["counts"].get("val_acc") or [] if a is not None]
    return [
        log_child(
            mlflow,
            parent,
            "train",
            params,
            counts,
            val_acc,
            steps,
            {"stage": "train"},
            curve_name="val_acc_per_ttt_step",
        )
    ]


def ddp_children(mlflow, parent, folder: Path) -> list:
    """One run per ddp_<N>gpu_progress.log: its training rate on N devices."""
    children = []
    for devices in (1, 2, 4, 8):
        log = folder / f"ddp_{devices}gpu_progress.log"
        if log.exists():
            steps = progress_rows(log)
            children.append(
                log_child(
                    mlflow,
                    parent,
                    f"ddp {devices} gpu",
                    {"trainer.devices": devices},
                    ddp_rate(steps, devices),
                    steps=steps,
                    tags={"stage": "train"},
                )
            )
    return children


def bench_children(mlflow, parent, folder: Path) -> list:
    """The rows of e2e.json or e2e_<variant>.json (one engine setting each), and all suites per method."""
    e2e_files = {
        path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("e2e*.json"))
    }
    off_rows = [r for r in e2e_files.get("e2e", {"rows": []})["rows"] if r["method"] == "off"]
    children = []
    for stem, data in e2e_files.items():
        variant = stem.removeprefix("e2e").lstrip("_")
        for name, params, metrics, curve in e2e_runs(data) + all_suites_runs(data, off_rows):
            params["engine_variant"] = variant or "default"
            children.append(
                log_child(
                    mlflow,
                    parent,
                    f"{name} {variant}".strip(),
                    params,
                    metrics,
                    curve,
                    tags={"stage": "bench"},
                )
            )
    return children


def engine_children(mlflow, parent, folder: Path) -> list:
    """The rows of engine_<path>.json files."""
    children = []
    for path in sorted(folder.glob("engine_*.json")):
        path_name = path.stem.removeprefix("engine_")
        for name, params, metrics, _curve in engine_runs(json.loads(path.read_text()), path_name):
            children.append(
                log_child(mlflow, parent, name, params, metrics, tags={"stage": "engine"})
            )
    return children


def ddp_rate(steps: list[dict], devices: int) -> dict:
    """Samples/s from the first to the last progress line (start-up excluded). Each line's rate
    covers the steps since the line before, and every step takes batch_size x devices samples,
    so the whole span's rate is the step-weighted harmonic mean of the line rates."""
    steps = [row for row in steps if "train/samples_per_s" in row]  # not the validation rows
    if len(steps) < 2:
        return {}
    pairs = list(zip(steps, steps[1:]))
    done = sum(b["step"] - a["step"] for a, b in pairs)
    return {
        "samples_per_s": done
        / sum((b["step"] - a["step"]) / b["train/samples_per_s"] for a, b in pairs),
        "devices": float(devices),
    }


def imported_line(folder: Path, summary: dict) -> str:
    return (
        f"imported {folder.name}: parent run {summary['parent']}, {summary['children']} child runs "
        f"({summary['replaced']} earlier runs replaced) into {summary['uri']}"
    )


def file_totals(files: list[Path]) -> list[dict]:
    """Each method's suites summed over the rows of these engine-loop JSONs."""
    return totals([row for path in files for row in json.loads(path.read_text())["rows"]])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m eagle3.tools.results",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    imported = commands.add_parser("import", help="a result folder into the MLflow store")
    imported.add_argument("folder", type=Path)
    imported.add_argument("overrides", nargs="*", help="Hydra overrides (tracking.*, paths.root)")
    summed = commands.add_parser("totals", help="each method's suites summed over bench files")
    summed.add_argument(
        "files", nargs="+", type=Path, help="engine-loop JSONs (e2e*.json in results/)"
    )
    summed.add_argument("--json", type=Path, help="write the totals here")
    args = parser.parse_args(argv)
    if args.command == "import":
        print(imported_line(args.folder, import_folder(args.folder, args.overrides)))
        return
    result = file_totals(args.files)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
