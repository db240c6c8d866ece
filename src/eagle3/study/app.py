"""`python -m eagle3.study`: how much data buys how much acceptance.

One data stage output; drafters trained from scratch with the composed recipe on nested prefixes of
its train split (`train.limit`, study.sizes); each one's val tau_hat (the train manifest) and engine
tau at the composed spec over the first study.prompts prompts of each suite in study.suites (greedy,
the embedded decoder); then tau = a + b * ln(x) fitted against training tokens and training FLOPs,
a plot of both with the fit drawn out to study.extrapolate times the largest size, and one MLflow
parent run with a child per size. Sizes are fractions or row counts of the split, or training tokens
(study.size_unit=tokens: data sets of other row lengths meet at equal token passes). Each drafter is an
ordinary train stage output: a rerun skips the sizes already trained, so an interrupted study resumes.
Output: <artifacts>/study/<hash>/ with study.json, study.png and study.md. study.log_from pools
study.json files of one recipe; study.compare draws studies on other data side by side
(eagle3.study.report draws and writes).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig

from eagle3.core import tracking
from eagle3.core.artifacts import StageOutput, config_hash, stage_output
from eagle3.core.common import Eagle3Error, app, log
from eagle3.core.config import (
    BenchConfig,
    Config,
    DrafterConfig,
    EngineConfig,
    SpecConfig,
    StudyConfig,
    TrackingConfig,
    TrainConfig,
    plain,
)
from eagle3.core.drafter_io import load_trained_drafter
from eagle3.core.spec import Spec, resolve_spec
from eagle3.core.target import load_target
from eagle3.data import stage as data_stage
from eagle3.data.splits import load_splits
from eagle3.data.suites import load_suite
from eagle3.engine.decoder import DecodeRequest, SpecDecoder
from eagle3.engine.evaluate import summarize
from eagle3.engine.options import DecoderOptions
from eagle3.study.report import (
    compare_plot,
    compare_table,
    fit_lines,
    fits_for,
    labelled,
    plot,
    reference_points,
    table,
)
from eagle3.train import stage as train

# ---------------------------------------------------------------- sizes and their configs


def row_counts(sizes, n_train: int) -> list[int]:
    """Train rows per drafter, ascending: a fraction (<= 1) of the split or a row count (> 1)."""
    counts = set()
    for size in sizes:
        rows = round(float(size) * n_train) if float(size) <= 1 else int(size)
        if not 1 <= rows <= n_train:
            raise Eagle3Error(
                f"study.sizes entry {size}: {rows} rows, but the train split holds {n_train}"
            )
        counts.add(rows)
    return distinct(counts, sizes)


def rows_for_tokens(sizes, row_tokens: list[int]) -> list[int]:
    """Train rows per drafter, ascending: the shortest prefix of the split holding each size's tokens
    (row_tokens: each row's tokens as trained, cut at train.max_length), so that data sets of other
    row lengths are compared at equal token passes."""
    cumulative, total = [], 0
    for tokens in row_tokens:
        total += tokens
        cumulative.append(total)
    counts = set()
    for size in sizes:
        wanted = float(size)
        if not 0 < wanted <= total:
            raise Eagle3Error(
                f"study.sizes entry {size}: {wanted:,.0f} tokens, but the train split holds {total:,}"
            )
        counts.add(bisect.bisect_left(cumulative, wanted) + 1)
    return distinct(counts, sizes)


def distinct(counts: set[int], sizes) -> list[int]:
    if len(counts) < 2:
        raise Eagle3Error(f"study.sizes={list(sizes)}: a fit needs at least two distinct sizes")
    return sorted(counts)


def size_rows(study: StudyConfig, max_length: int, data_path: Path) -> tuple[list[int], int]:
    """(train rows per drafter, rows in the train split) for study.sizes in study.size_unit, a row's
    tokens cut at train.max_length."""
    split = load_splits(data_path)["train"]
    if study.size_unit == "rows":
        return row_counts(study.sizes, len(split)), len(split)
    if study.size_unit != "tokens":
        raise Eagle3Error(f"study.size_unit={study.size_unit!r}: use rows or tokens")
    lengths = [min(len(ids), max_length) for ids in split["input_ids"]]
    return rows_for_tokens(study.sizes, lengths), len(split)


def study_sections(
    study: StudyConfig, train: TrainConfig, drafter: DrafterConfig, spec: SpecConfig
) -> dict:
    """The settings a study's output folder is hashed from."""
    kept = {
        k: v
        for k, v in plain(study).items()
        if k not in ("log_from", "references", "compare", "label")
    }
    return {
        "study": kept,
        "train": plain(train),
        "drafter": plain(drafter),
        "spec": plain(spec),
        "bench": {"max_new_tokens": study.max_new_tokens},
    }


# ---------------------------------------------------------------- tokens and FLOPs


def prefix_tokens(data_path: Path, rows: int, max_length: int) -> tuple[int, int]:
    """(tokens, trained tokens) in the first `rows` train rows, each cut at train.max_length."""
    split = load_splits(data_path)["train"].select(range(rows))
    tokens = trained = 0
    for ids, mask in zip(split["input_ids"], split["loss_mask"]):
        tokens += min(len(ids), max_length)
        trained += sum(mask[:max_length])
    return tokens, trained


def flops_per_token(train: TrainConfig, target_params: int, drafter_params: int) -> float:
    """Training FLOPs per token and epoch: the target's forward (2 N) when hidden states are made
    online, and the drafter's forward and backward (6 N) once per TTT step."""
    target = 2 * target_params if train.hidden_states == "online" else 0
    return float(target + 6 * drafter_params * train.ttt_length)


def parameter_counts(target, train_dir: Path) -> tuple[int, int]:
    """(target parameters, drafter parameters without its frozen embedding)."""
    drafter = load_trained_drafter(train_dir, target)
    n_target = sum(p.numel() for p in target.model.parameters())
    n_drafter = sum(v.numel() for v in drafter.trainable_state_dict().values())
    return n_target, n_drafter


# ---------------------------------------------------------------- engine tau


def suite_name(suite: str) -> str:
    """A study.suites entry's name: the bench suite's, or a JSONL file's stem without `suite_`."""
    return Path(suite).stem.removeprefix("suite_") if suite.endswith(".jsonl") else suite


def suite_prompt_ids(
    study: StudyConfig, bench: BenchConfig, tokenizer
) -> dict[str, list[list[int]]]:
    """The token ids of the first study.prompts prompts of each study.suites entry: a bench suite's
    name, or a JSONL file of its prompts (`python -m eagle3.data.prompt_files --suites`, for a machine
    without the suites' packages)."""
    prompts = {}
    for suite in map(str, study.suites):
        source = (
            {"prompts": suite} if suite.endswith(".jsonl") else {"suite": suite, "prompts": None}
        )
        chosen = load_suite(dataclasses.replace(bench, **source, limit=None))[: study.prompts]
        prompts[suite_name(suite)] = [
            tokenizer.apply_chat_template(
                p.messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            for p in chosen
        ]
    return prompts


def decoder_for(
    ecfg: EngineConfig, torch_compile: bool, target, drafter, spec: Spec
) -> SpecDecoder:
    """The embedded decoder with the engine section's settings (study.compile: torch.compile)."""
    graphs = target.device.type == "cuda" if ecfg.cuda_graphs == "auto" else bool(ecfg.cuda_graphs)
    compiled = bool(torch_compile) and graphs
    return SpecDecoder(
        target,
        drafter,
        spec,
        DecoderOptions(
            max_context=ecfg.max_context,
            cuda_graphs=graphs,
            lean=ecfg.lean_forward,
            compile_layers=compiled,
            compile_draft=compiled,
            compile_prefill=compiled,
            prefill_graphs=tuple(ecfg.prefill_graphs or ()) if graphs else (),
            draft_attention=ecfg.draft_attention,
            tree_temperature=ecfg.tree_temperature,
        ),
    )


def engine_tau(
    target, train_dir: Path, prompts: dict, spec: Spec, ecfg: EngineConfig, study: StudyConfig
) -> dict:
    """{suite: tau, ..., "all": tau over every prompt} for the drafter trained in train_dir."""
    dtype = next(target.model.parameters()).dtype
    drafter = load_trained_drafter(train_dir, target).to(dtype).eval()
    decoder = decoder_for(ecfg, study.compile, target, drafter, spec)
    stop = [target.tokenizer.eos_token_id] if target.tokenizer.eos_token_id is not None else []
    every, taus = [], {}
    for suite, suite_prompts in prompts.items():
        stats = [
            decoder.generate(DecodeRequest(ids, study.max_new_tokens, stop_ids=stop)).stats
            for ids in suite_prompts
        ]
        taus[suite] = summarize(stats)["tau"]
        every += stats
    taus["all"] = summarize(every)["tau"]
    return taus


# ---------------------------------------------------------------- MLflow


def log_mlflow(
    tcfg: TrackingConfig, open_run: Callable, result: dict, files: list[Path]
) -> str | None:
    """One parent run (the fits, the plot, study.json; open_run: eagle3.core.tracking.stage_run
    bound to the config) and a child run per size."""
    if not tcfg.enabled:
        return None
    import mlflow

    with open_run("study", artifact_hash=result["hash"]) as parent:
        for key, fit in result["fits"].items():
            name = key.replace("~", "_vs_")
            mlflow.log_metrics(
                {f"{name}/a": fit["a"], f"{name}/b": fit["b"], f"{name}/r2": fit["r2"]}
            )
        for path in files:
            mlflow.log_artifact(str(path))
        parent_id, experiment_id = parent.info.run_id, parent.info.experiment_id
    client = mlflow.MlflowClient(tracking_uri=tcfg.uri)
    for point in result["points"]:
        child = client.create_run(
            experiment_id,
            run_name=f"study rows={point['rows']}",
            tags={"mlflow.parentRunId": parent_id, "stage": "study-size"},
        )
        run_id = child.info.run_id
        for key in ("rows", "train_hash", "train_limit"):
            client.log_param(run_id, key, point.get(key))
        for key in ("train_tokens", "trained_tokens", "train_flops", "val_tau_hat", "engine_tau"):
            if point.get(key) is not None:
                client.log_metric(run_id, key, float(point[key]))
        for suite, tau in point["suite_tau"].items():
            client.log_metric(run_id, f"engine_tau/{suite}", float(tau))
        client.set_terminated(run_id)
    return parent_id


# ---------------------------------------------------------------- the app


def train_sizes(
    train_cfg: TrainConfig,
    study: StudyConfig,
    data_path: Path,
    train_drafter: Callable[[int | None], StageOutput],
) -> list[dict]:
    """Train (or find) one drafter per size (train_drafter(train.limit), null for the whole split:
    the plain recipe's drafter); a point per size without its engine tau yet."""
    if train_cfg.init_from:
        raise Eagle3Error(
            f"train.init_from={train_cfg.init_from}: the study trains every size from scratch"
        )
    sizes, n_train = size_rows(study, train_cfg.max_length, data_path)
    points = []
    for rows in sizes:
        limit = None if rows == n_train else rows
        started = time.monotonic()
        log.info("study: drafter on %d of %d train rows", rows, n_train)
        out = train_drafter(limit)
        counts = out.manifest().get("counts", {})
        tokens, trained = prefix_tokens(data_path, rows, train_cfg.max_length)
        points.append(
            {
                "rows": rows,
                "train_limit": limit,
                "train_hash": out.hash,
                "train_dir": str(out.path),
                "epochs": train_cfg.epochs,
                "train_tokens": tokens * train_cfg.epochs,
                "trained_tokens": trained * train_cfg.epochs,
                "val_tau_hat": counts.get("tau_hat"),
                "val_tau_hat_head": counts.get("tau_hat_head"),
                "train_seconds": counts.get("seconds", time.monotonic() - started),
            }
        )
    return points


def measure(
    points: list[dict],
    target,
    spec: Spec,
    study: StudyConfig,
    bench: BenchConfig,
    ecfg: EngineConfig,
    train_cfg: TrainConfig,
) -> None:
    """Each point's engine tau (per suite and overall) and its training FLOPs."""
    prompts = suite_prompt_ids(study, bench, target.tokenizer)
    n_target, n_drafter = parameter_counts(target, Path(points[0]["train_dir"]))
    per_token = flops_per_token(train_cfg, n_target, n_drafter)
    for point in points:
        taus = engine_tau(target, Path(point["train_dir"]), prompts, spec, ecfg, study)
        point["suite_tau"] = {s: taus[s] for s in prompts}
        point["engine_tau"] = taus["all"]
        point["train_flops"] = point["train_tokens"] * per_token
        log.info(
            "study: %d rows: engine tau %.3f, val tau_hat %s",
            point["rows"],
            taus["all"],
            point["val_tau_hat"],
        )


def study_title(target_name: str, epochs: int, study: StudyConfig, spec_label: str) -> str:
    return (
        f"{target_name}: drafters from scratch, {epochs} epoch(s) each; engine τ at "
        f"{spec_label} over {len(study.suites)} suites x {study.prompts} prompts"
    )


def write_outputs(study: StudyConfig, result: dict, folder: Path) -> list[Path]:
    title, suites = result["title"], result["suites"]
    references = reference_points(study.references, result["points"])
    png = plot(
        result["points"],
        result["fits"],
        study.extrapolate,
        title,
        folder / "study.png",
        references,
    )
    (folder / "study.json").write_text(json.dumps(result, indent=2))
    md = folder / "study.md"
    md.write_text(
        f"# {title}\n\n{table(result['points'], suites)}\n\n{fit_lines(result['fits'])}\n"
    )
    return [folder / "study.json", png, md]


def run(cfg: Config) -> StageOutput:
    """The study this config describes (a no-op when its output is complete)."""
    spec = resolve_spec(cfg.spec)
    data = data_stage.run(cfg)
    sections = study_sections(cfg.study, cfg.train, cfg.drafter, cfg.spec)
    out = stage_output(cfg.paths.artifacts, "study", sections, {"data": data.hash})
    if out.complete:
        log.info("study: %s is complete, nothing to do", out.path)
        return out
    out.start()

    def train_drafter(limit: int | None) -> StageOutput:
        return train.run(
            dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, limit=limit))
        )

    points = train_sizes(cfg.train, cfg.study, data.path, train_drafter)
    measure(
        points,
        load_target(cfg.target, cfg.paths.artifacts),
        spec,
        cfg.study,
        cfg.bench,
        cfg.engine,
        cfg.train,
    )
    result = {
        "hash": out.hash,
        "data_hash": data.hash,
        "overrides": job_overrides(),
        "label": cfg.study.label,
        "spec": spec.label,
        "title": study_title(cfg.target.name, cfg.train.epochs, cfg.study, spec.label),
        "suites": [suite_name(str(s)) for s in cfg.study.suites],
        "epochs": cfg.train.epochs,
        "points": points,
        "fits": fits_for(points, cfg.study.goal_tau),
    }
    files = write_outputs(cfg.study, result, out.path)
    parent = log_mlflow(cfg.tracking, functools.partial(tracking.stage_run, cfg), result, files)
    out.finish({"sizes": len(points), "mlflow_parent_run": parent})
    print(table(points, result["suites"]))
    print(fit_lines(result["fits"]))
    return out


def pooled(paths: list[Path]) -> dict:
    """One result from several study.json files of one recipe (other sizes or epochs): their points
    together, sorted by training tokens; the first file's spec and suites."""
    results = []
    for path in paths:
        if not path.exists():
            raise Eagle3Error(f"study.log_from: {path} does not exist (a study.json)")
        results.append(json.loads(path.read_text()))
    first = results[0]
    for path, other in zip(paths[1:], results[1:]):
        if (other["spec"], other["suites"], other["data_hash"]) != (
            first["spec"],
            first["suites"],
            first["data_hash"],
        ):
            raise Eagle3Error(
                f"study.log_from: {path} measured spec {other['spec']} on {other['suites']} with data "
                f"{other['data_hash']}, {paths[0]} spec {first['spec']} on {first['suites']} with "
                f"data {first['data_hash']}: not one study"
            )
    points = sorted(
        ({"epochs": r.get("epochs", 1), **p} for r in results for p in r["points"]),
        key=lambda p: p["train_tokens"],
    )
    if len(results) == 1:
        return {**first, "points": points}
    epochs = sorted({p["epochs"] for p in points})
    title = first["title"].replace(f"{first.get('epochs', 1)} epoch(s) each", f"{epochs} epochs")
    hash_ = config_hash(sorted(r["hash"] for r in results))
    return {**first, "hash": hash_, "title": title, "epochs": epochs, "points": points}


def log_from(
    study: StudyConfig, artifacts, tcfg: TrackingConfig, open_run: Callable, paths: list[Path]
) -> Path:
    """Log study.json files written elsewhere (pooled when several) and redraw their outputs: beside
    a single file, in <artifacts>/study/pooled-<hash> for several."""
    result = pooled(paths)
    result["fits"] = fits_for(result["points"], study.goal_tau)
    folder = paths[0].parent
    if len(paths) > 1:
        folder = Path(artifacts) / "study" / f"pooled-{result['hash']}"
        folder.mkdir(parents=True, exist_ok=True)
    files = write_outputs(study, result, folder)
    parent = log_mlflow(tcfg, open_run, result, files)
    print(table(result["points"], result["suites"]))
    print(fit_lines(result["fits"]))
    print(f"study: {folder} (MLflow parent run {parent})")
    return folder


# ---------------------------------------------------------------- studies of other data, side by side


def job_overrides() -> list[str]:
    """The command-line overrides of this Hydra job (what tells a multirun's studies apart)."""
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:  # not under Hydra (called from Python)
        return []


def compare(artifacts, tcfg: TrackingConfig, open_run: Callable, paths: list[Path]) -> Path:
    """Studies of the same recipe on other data (a multirun over data options) side by side: one
    plot and table in <artifacts>/study/compare-<hash>, logged as one MLflow run (open_run:
    eagle3.core.tracking.stage_run bound to the config)."""
    results = labelled(paths)
    hash_ = config_hash(sorted(r["hash"] for r in results))
    folder = Path(artifacts) / "study" / f"compare-{hash_}"
    folder.mkdir(parents=True, exist_ok=True)
    text = compare_table(results)
    (folder / "compare.md").write_text(f"# Engine τ of studies on other data\n\n{text}\n")
    (folder / "compare.json").write_text(json.dumps(results, indent=2))
    files = [
        folder / "compare.md",
        folder / "compare.json",
        compare_plot(results, folder / "compare.png"),
    ]
    if tcfg.enabled:
        import mlflow

        with open_run("study-compare", artifact_hash=hash_):
            for path in files:
                mlflow.log_artifact(str(path))
    print(text)
    print(f"study: {folder}")
    return folder


@app
def main(cfg: Config) -> None:
    open_run = functools.partial(tracking.stage_run, cfg)
    if cfg.study.compare:
        compare(
            cfg.paths.artifacts, cfg.tracking, open_run, [Path(str(p)) for p in cfg.study.compare]
        )
        return
    if cfg.study.log_from:
        sources = cfg.study.log_from
        sources = [sources] if isinstance(sources, str) else list(sources)
        paths = [Path(str(p)) for p in sources]
        log_from(cfg.study, cfg.paths.artifacts, cfg.tracking, open_run, paths)
        return
    out = run(cfg)
    print(f"study: {out.path}")


if __name__ == "__main__":
    main()
