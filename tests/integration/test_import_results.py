"""python -m eagle3.tools.results import: a GPU machine's result folder lands in a real MLflow store
(sqlite), one child run per result row, with values equal to the files'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from support import REPO as ROOT

from eagle3.tools.results import import_folder, imported_line

RESULTS = ROOT / "results" / "smollm2-135m_h200_2026-11-30"


def run_import(tmp_path: Path, folder: Path = RESULTS) -> str:
    """import_folder on `folder` into a sqlite store under tmp_path; the line the command prints."""
    return imported_line(folder, import_folder(folder, [f"paths.root={tmp_path}"]))


def test_import_logs_every_row_and_replaces_on_reimport(tmp_path):
    e2e = json.loads((RESULTS / "e2e.json").read_text())["rows"]
    engine = sum(
        len(json.loads((RESULTS / f"engine_{p}.json").read_text())["rows"])
        for p in ("step_by_step", "fused")
    )
    methods = len({r["method"] for r in e2e})
    assert "43 child runs (0 earlier" in run_import(
        tmp_path
    )  # train + 2 ddp + 24 bench + 8 all-suites + 8 engine
    assert len(e2e) + methods + engine + 3 == 43
    assert "44 earlier runs replaced" in run_import(tmp_path)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    experiment = client.get_experiment_by_name("eagle3").experiment_id
    runs = {r.info.run_name: r for r in client.search_runs([experiment], max_results=1000)}
    assert len(runs) == 44
    parent = runs[RESULTS.name].info.run_id
    assert all(
        r.data.tags["mlflow.parentRunId"] == parent for n, r in runs.items() if n != RESULTS.name
    )
    row = next(r for r in e2e if r["suite"] == "gsm8k" and r["method"] == "d6s3k2")
    off = next(r for r in e2e if r["suite"] == "gsm8k" and r["method"] == "off")
    metrics = runs["gsm8k d6s3k2"].data.metrics
    assert metrics["tok_per_s"] == row["tok_per_s"] and metrics["tau"] == row["tau"]
    assert metrics["speedup_vs_off"] == row["tok_per_s"] / off["tok_per_s"]
    curve = client.get_metric_history(runs["gsm8k d6s3k2"].info.run_id, "acceptance_per_position")
    assert [m.value for m in sorted(curve, key=lambda m: m.step)] == row["acceptance_per_position"]
    progress = (RESULTS / "train_progress.log").read_text().count("train: step")
    assert len(client.get_metric_history(runs["train"].info.run_id, "train/tau_hat")) == progress
    assert (
        runs["train"].data.metrics["final/tau_hat"]
        == json.loads((RESULTS / "train_manifest.json").read_text())["counts"]["tau_hat"]
    )
    assert runs["ddp 2 gpu"].data.metrics["devices"] == 2.0


def test_import_logs_the_per_ttt_step_accuracies(tmp_path):
    """A train manifest written since the val accuracies per TTT step went into it."""
    import shutil

    folder = tmp_path / "h200-run"
    shutil.copytree(RESULTS, folder)
    manifest = json.loads((folder / "train_manifest.json").read_text())
    manifest["counts"]["val_acc"] = [0.5, 0.25, 0.125]
    (folder / "train_manifest.json").write_text(json.dumps(manifest))
    run_import(tmp_path, folder)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    train = client.search_runs(
        [client.get_experiment_by_name("eagle3").experiment_id], "attributes.run_name = 'train'"
    )[0]
    curve = client.get_metric_history(train.info.run_id, "val_acc_per_ttt_step")
    assert [(m.step, m.value) for m in sorted(curve, key=lambda m: m.step)] == [
        (0, 0.5),
        (1, 0.25),
        (2, 0.125),
    ]


def test_import_takes_every_e2e_and_engine_file_of_a_folder(tmp_path):
    """A folder with several engine settings (e2e_<variant>.json, engine_<variant>.json): a child run
    per row of every file, the variant in the run name and params, the phase times as metrics."""
    folder = ROOT / "results" / "smollm2-135m_h200_2026-11-30c"
    e2e = {p.stem: json.loads(p.read_text())["rows"] for p in folder.glob("e2e*.json")}
    engine = sum(len(json.loads(p.read_text())["rows"]) for p in folder.glob("engine_*.json"))
    methods = sum(
        len({r["method"] for r in rows}) for rows in e2e.values()
    )  # an all-suites run each
    children = (
        1 + sum(map(len, e2e.values())) + methods + engine
    )  # train + bench rows + totals + engine rows
    out = run_import(tmp_path, folder)
    assert f"{children} child runs (0 earlier" in out and len(e2e) == 5
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = {
        r.info.run_name: r
        for r in client.search_runs(
            [client.get_experiment_by_name("eagle3").experiment_id], max_results=1000
        )
    }
    assert len(runs) == children + 1
    row = next(
        r
        for r in e2e["e2e_compiled_prefill_graphs"]
        if r["suite"] == "gsm8k" and r["method"] == "d6s3k2"
    )
    run = runs["gsm8k d6s3k2 compiled_prefill_graphs"]
    assert run.data.params["engine_variant"] == "compiled_prefill_graphs"
    assert run.data.metrics["tok_per_s"] == row["tok_per_s"]
    assert run.data.metrics["prefill_ms_per_prompt"] == row["prefill_ms_per_prompt"]
    assert (
        runs["gsm8k d6s3k2"].data.metrics["tok_per_s"]
        == next(r for r in e2e["e2e"] if r["suite"] == "gsm8k" and r["method"] == "d6s3k2")[
            "tok_per_s"
        ]
    )


def test_import_keeps_the_last_line_of_a_repeated_step_and_the_validations(tmp_path):
    """A train log cut by kills and resumed repeats the steps since the last checkpoint: one point per
    step, the later line's value. Validation lines become val/* metrics at their step."""
    import shutil

    folder = tmp_path / "h200-resumed"
    shutil.copytree(ROOT / "results" / "smollm2-135m_h200_2026-12-01", folder)
    log = folder / "train_progress.log"
    lines = log.read_text().splitlines()
    repeated = lines[100].replace(
        "tau_hat ", "tau_hat 9"
    )  # step of line 100, run again after a resume
    validations = [
        "[t][eagle3][INFO] - train: validation after epoch 0 (step 861): tau_hat 2.500, over the first "
        "128 tokens 2.100, loss 9.1000, acc 0.700 0.600",
        "[t][eagle3][INFO] - train: validation after epoch 1 (step 1722): tau_hat 3.000, loss 8.0000, acc 0.8",
    ]
    log.write_text("\n".join(lines + [repeated] + validations) + "\n")
    run_import(tmp_path, folder)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    train = client.search_runs(
        [client.get_experiment_by_name("eagle3").experiment_id], "attributes.run_name = 'train'"
    )[0].info.run_id
    history = {m.step: m.value for m in client.get_metric_history(train, "train/tau_hat")}
    steps = [int(line.split("train: step ")[1].split("/")[0]) for line in lines]
    assert len(client.get_metric_history(train, "train/tau_hat")) == len(set(steps)) == len(history)
    step = int(repeated.split("train: step ")[1].split("/")[0])
    assert history[step] == float(repeated.split("tau_hat ")[1].split()[0]) > 9
    assert [(m.step, m.value) for m in client.get_metric_history(train, "val/tau_hat")] in (
        [(861, 2.5), (1722, 3.0)],
        [(1722, 3.0), (861, 2.5)],
    )
    assert [(m.step, m.value) for m in client.get_metric_history(train, "val/tau_hat_head")] == [
        (861, 2.1)
    ]
    assert sorted(m.value for m in client.get_metric_history(train, "val/loss")) == [8.0, 9.1]


def test_import_attaches_the_folders_plots_to_the_parent_run(tmp_path):
    """Run 2026-12-01b's folder: a child run per bench row and all-suites method plus the train run, and its
    tree_shapes.png as an artifact of the parent run, byte for byte."""
    folder = ROOT / "results" / "smollm2-135m_h200_2026-12-01b"
    files = [json.loads(p.read_text())["rows"] for p in folder.glob("e2e*.json")]
    rows, methods = sum(map(len, files)), sum(len({r["method"] for r in f}) for f in files)
    out = run_import(tmp_path, folder)
    assert f"{rows + methods + 1} child runs (0 earlier" in out and (rows, methods) == (24, 8)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    parent = client.search_runs(
        [client.get_experiment_by_name("eagle3").experiment_id],
        f"attributes.run_name = '{folder.name}'",
    )[0].info.run_id
    assert [a.path for a in client.list_artifacts(parent)] == ["tree_shapes.png"]
    copy = client.download_artifacts(parent, "tree_shapes.png", str(tmp_path))
    assert Path(copy).read_bytes() == (folder / "tree_shapes.png").read_bytes()


def test_import_sums_each_methods_suites_against_off_of_the_same_run(tmp_path):
    """An "all <method>" run per method and e2e file: tokens over wall time summed over the suites, τ over
    the summed verify steps, the ratio to spec=off's sums; a file without off rows (e2e_deeper.json) takes
    e2e.json's."""
    folder = ROOT / "results" / "smollm2-135m_h200_2026-12-02c"
    run_import(tmp_path, folder)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = {
        r.info.run_name: r
        for r in client.search_runs(
            [client.get_experiment_by_name("eagle3").experiment_id], max_results=1000
        )
    }
    rows = {p.stem: json.loads(p.read_text())["rows"] for p in folder.glob("e2e*.json")}
    assert not any(r["method"] == "off" for r in rows["e2e_deeper"])
    off = [r for r in rows["e2e"] if r["method"] == "off"]
    off_rate = sum(r["tokens"] for r in off) / sum(r["wall_s"] for r in off)
    for name, file, method in [
        ("all d32s4k8", "e2e", "d32s4k8"),
        ("all d48s5k8 deeper", "e2e_deeper", "d48s5k8"),
    ]:
        group = [r for r in rows[file] if r["method"] == method]
        assert len(group) == 3
        tokens, wall = sum(r["tokens"] for r in group), sum(r["wall_s"] for r in group)
        metrics = runs[name].data.metrics
        assert metrics["tok_per_s"] == pytest.approx(tokens / wall, rel=1e-12)
        assert metrics["tau"] == pytest.approx(
            tokens / sum(r["verify_steps"] for r in group), rel=1e-12
        )
        assert metrics["speedup_vs_off"] == pytest.approx(tokens / wall / off_rate, rel=1e-12)
        assert runs[name].data.params["bench.suite"] == "all"
    assert (
        round(runs["all d32s4k8"].data.metrics["speedup_vs_off"], 3) == 2.498
    )  # results/smollm2-135m_h200_2026-12-02c.md
    assert "all off deeper" not in runs and runs["all off"].data.metrics["speedup_vs_off"] == 1.0
