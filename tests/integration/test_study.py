"""The scaling study on the tiny random target: nested train prefixes, one drafter per size, engine
tau per suite, the log fit, its MLflow parent and children, and a resumed rerun."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
from support import FIXTURES

from eagle3.core.common import Eagle3Error
from eagle3.core.tracking import stage_run
from eagle3.study.app import row_counts, rows_for_tokens
from eagle3.study.report import fit_log, needed_for


def log_from(study, cfg, paths):
    """study.log_from as `python -m eagle3.study study.log_from=...` calls it."""
    open_run = functools.partial(stage_run, cfg)
    return study.log_from(cfg.study, cfg.paths.artifacts, cfg.tracking, open_run, paths)


def compare(study, cfg, paths):
    """study.compare as `python -m eagle3.study study.compare=...` calls it."""
    open_run = functools.partial(stage_run, cfg)
    return study.compare(cfg.paths.artifacts, cfg.tracking, open_run, paths)


def test_fit_log_recovers_a_line_and_inverts_it():
    xs = [1e3, 2e3, 4e3, 1e4]
    fit = fit_log(xs, [1.5 + 0.25 * math.log(x) for x in xs])
    assert fit["a"] == pytest.approx(1.5) and fit["b"] == pytest.approx(0.25)
    assert fit["r2"] == pytest.approx(1.0)
    assert fit["per_doubling"] == pytest.approx(0.25 * math.log(2))
    assert needed_for(fit, 1.5 + 0.25 * math.log(5e4)) == pytest.approx(5e4)
    assert needed_for(fit_log(xs, [3.0, 2.0, 2.0, 1.0]), 4.0) is None  # falling: never


def test_row_counts_take_fractions_and_counts():
    assert row_counts([0.1, 0.5, 1.0, 3], 40) == [3, 4, 20, 40]
    with pytest.raises(
        Eagle3Error, match="study.sizes entry 50: 50 rows, but the train split holds 40"
    ):
        row_counts([0.5, 50], 40)
    with pytest.raises(Eagle3Error, match="at least two distinct sizes"):
        row_counts([1.0, 40], 40)


def test_rows_for_tokens_are_the_shortest_prefixes_holding_them():
    lengths = [5, 1, 7, 3, 3, 9, 2]

    def brute_force(tokens):
        return next(n for n in range(1, len(lengths) + 1) if sum(lengths[:n]) >= tokens)

    sizes = [1, 5, 6, 6.5, 13, 14, 30]
    assert rows_for_tokens(sizes, lengths) == sorted({brute_force(t) for t in sizes})
    assert rows_for_tokens([6, 13], lengths) == [2, 3]
    with pytest.raises(
        Eagle3Error, match="study.sizes entry 31: 31 tokens, but the train split holds 30"
    ):
        rows_for_tokens([5, 31], lengths)
    with pytest.raises(Eagle3Error, match="at least two distinct sizes"):
        rows_for_tokens([6.5, 13], lengths)


def test_study_trains_nested_sizes_measures_and_logs(make_cfg, own_artifacts, tmp_path):
    import mlflow

    from eagle3.data.splits import load_splits
    from eagle3.data.suites import load_suite
    from eagle3.study import app as study

    # a suite as a JSONL file (a machine without the suites' packages) beside one by name
    gsm8k = tmp_path / "suite_gsm8k.jsonl"
    rows = load_suite(make_cfg("bench.suite=gsm8k", "bench.limit=2").bench)
    gsm8k.write_text("".join(json.dumps({"id": p.id, "messages": p.messages}) + "\n" for p in rows))
    overrides = _study_overrides(FIXTURES / "conversations.jsonl", own_artifacts, gsm8k)
    cfg = make_cfg(*overrides, "study.sizes=[0.25,0.5,1.0]")
    out = study.run(cfg)
    result = json.loads((out.path / "study.json").read_text())
    data_path = own_artifacts / "data" / result["data_hash"]
    n_train = len(load_splits(data_path)["train"])
    points = result["points"]
    assert [p["rows"] for p in points] == [round(0.25 * n_train), round(0.5 * n_train), n_train]
    assert [p["train_limit"] for p in points] == [points[0]["rows"], points[1]["rows"], None]
    assert len({p["train_hash"] for p in points}) == 3
    for point in points:  # tokens: the first rows of the split, each cut at train.max_length
        rows = load_splits(data_path)["train"].select(range(point["rows"]))
        assert point["train_tokens"] == sum(min(len(ids), 64) for ids in rows["input_ids"])
        manifest = json.loads((Path(point["train_dir"]) / "manifest.json").read_text())
        assert manifest["counts"]["train_sequences"] == point["rows"]
        assert set(point["suite_tau"]) == {"vicuna", "gsm8k"} and point["engine_tau"] >= 1.0
        assert point["val_tau_hat"] == manifest["counts"]["tau_hat"]
    assert points[0]["train_flops"] / points[0]["train_tokens"] == pytest.approx(
        points[2]["train_flops"] / points[2]["train_tokens"]
    )
    assert set(result["fits"]) == {
        "engine_tau~train_tokens",
        "val_tau_hat~train_tokens",
        "engine_tau~train_flops",
        "val_tau_hat~train_flops",
    }
    assert (out.path / "study.png").stat().st_size > 10_000
    parent = mlflow.search_runs(
        experiment_names=[cfg.tracking.experiment],
        filter_string="tags.stage = 'study'",
        output_format="list",
    )
    assert len(parent) == 1
    children = mlflow.search_runs(
        experiment_names=[cfg.tracking.experiment],
        filter_string=f"tags.mlflow.parentRunId = '{parent[0].info.run_id}'",
        output_format="list",
    )
    assert sorted(int(c.data.params["rows"]) for c in children) == [p["rows"] for p in points]
    by_rows = {int(c.data.params["rows"]): c.data.metrics for c in children}
    assert by_rows[points[1]["rows"]]["engine_tau"] == pytest.approx(points[1]["engine_tau"])

    # a study of the same recipe over other sizes trains only the new one (the others are done)
    trained = sorted(own_artifacts.glob("train/*/manifest.json"))
    again = study.run(make_cfg(*overrides, "study.sizes=[0.25,0.75,1.0]"))
    assert again.hash != out.hash
    assert len(sorted(own_artifacts.glob("train/*/manifest.json"))) == len(trained) + 1

    # sizes in training tokens: the shortest prefixes holding them
    exact, past = points[0]["train_tokens"], points[1]["train_tokens"] + 1
    by_tokens = study.run(
        make_cfg(*overrides, "study.size_unit=tokens", f"study.sizes=[{exact},{past}]")
    )
    token_points = json.loads((by_tokens.path / "study.json").read_text())["points"]
    assert [p["rows"] for p in token_points] == [points[0]["rows"], points[1]["rows"] + 1]
    assert token_points[0]["train_hash"] == points[0]["train_hash"]
    assert token_points[1]["train_tokens"] >= past


def _study_overrides(source: Path, artifacts: Path, gsm8k: Path) -> list[str]:
    """A tiny online-trained study over `source`, `gsm8k` beside vicuna (composed more than once)."""
    return [
        "target=tiny-llama",
        "data=file",
        f"data.source={source}",
        "data.val_fraction=0.2",
        "drafter.draft_vocab_size=256",
        f"paths.artifacts={artifacts}",
        "train.hidden_states=online",
        "train.ttt_length=2",
        "train.max_length=64",
        "train.batch_size=2",
        "train.epochs=1",
        "train.lr=1e-2",
        "trainer.accelerator=cpu",
        "trainer.progress_bar=false",
        f"study.suites=[vicuna,{gsm8k}]",
        "study.prompts=2",
        "study.max_new_tokens=6",
        "spec.depth=3",
    ]


def _result(hash_: str, epochs: int, sizes: list[tuple[int, float]], spec: str = "d8") -> dict:
    """A study.json as the study writes it: points at `sizes` (rows, engine tau)."""
    return {
        "hash": hash_,
        "data_hash": "0123456789ab",
        "spec": spec,
        "title": f"tiny: drafters from scratch, {epochs} epoch(s) each",
        "suites": ["vicuna"],
        "epochs": epochs,
        "points": [
            {
                "rows": rows,
                "train_limit": rows,
                "train_hash": f"{hash_}{rows}",
                "train_tokens": rows * 100 * epochs,
                "train_flops": rows * 100 * epochs * 1e6,
                "val_tau_hat": tau + 0.1,
                "engine_tau": tau,
                "suite_tau": {"vicuna": tau},
            }
            for rows, tau in sizes
        ],
    }


def test_log_from_pools_study_files_and_draws_references(make_cfg, tmp_path):
    import mlflow

    from eagle3.study import app as study

    one, two = tmp_path / "a" / "study.json", tmp_path / "b" / "study.json"
    for path, result in (
        (one, _result("aaa", 1, [(10, 1.2), (40, 1.5)])),
        (two, _result("bbb", 2, [(10, 1.3), (15, 1.45)])),
    ):
        path.parent.mkdir()
        path.write_text(json.dumps(result))
    cfg = make_cfg(
        f"paths.artifacts={tmp_path / 'artifacts'}",
        "study.references=[{label: other, train_tokens: 50000, engine_tau: 2.5}]",
    )
    folder = log_from(study, cfg, [one, two])
    pooled = json.loads((folder / "study.json").read_text())
    assert [(p["rows"], p["epochs"]) for p in pooled["points"]] == [
        (10, 1),
        (10, 2),
        (15, 2),
        (40, 1),
    ]
    xs = [p["train_tokens"] for p in pooled["points"]]
    fit = {k: v for k, v in pooled["fits"]["engine_tau~train_tokens"].items() if k != "needed"}
    assert fit == pytest.approx(fit_log(xs, [1.2, 1.3, 1.45, 1.5]))
    assert (folder / "study.png").stat().st_size > 10_000 and folder.name.startswith("pooled-")
    parent = mlflow.search_runs(
        experiment_names=[cfg.tracking.experiment],
        filter_string="tags.stage = 'study'",
        output_format="list",
    )
    children = mlflow.search_runs(
        experiment_names=[cfg.tracking.experiment],
        filter_string=f"tags.mlflow.parentRunId = '{parent[0].info.run_id}'",
        output_format="list",
    )
    assert len(parent) == 1 and len(children) == 4
    two.write_text(json.dumps(_result("bbb", 2, [(10, 1.3)], spec="d32s4k8")))
    with pytest.raises(Eagle3Error, match="measured spec d32s4k8 on"):
        log_from(study, cfg, [one, two])
    with pytest.raises(Eagle3Error, match="give train_tokens and engine_tau or val_tau_hat"):
        study.reference_points([{"label": "x", "train_tokens": 1}], pooled["points"])


def test_train_limit_takes_a_prefix_and_names_the_split_size():
    import torch

    from eagle3.train.datamodule import TokenDataset, first_rows

    rows = [
        {"id": str(i), "input_ids": [1] * (i + 2), "loss_mask": [1] * (i + 2)} for i in range(5)
    ]
    split = {key: [r[key] for r in rows] for key in rows[0]}

    class Split(list):  # the datasets split's two access paths: by column and by row
        def __getitem__(self, key):
            return split[key] if isinstance(key, str) else list.__getitem__(self, key)

    dataset = TokenDataset(Split(rows))
    prefix = first_rows(dataset, 3)
    assert len(prefix) == 3 and prefix.lengths == [2, 3, 4]
    assert [prefix[i]["id"] for i in range(3)] == ["0", "1", "2"]
    assert torch.equal(prefix[2]["input_ids"], torch.ones(4, dtype=torch.long))
    assert first_rows(dataset, None) is dataset
    with pytest.raises(
        Eagle3Error, match=r"train.limit=6: the data's train split holds 5 rows \(use 1..5\)"
    ):
        first_rows(dataset, 6)


def test_compare_labels_studies_by_their_own_overrides_and_subtracts_the_first(make_cfg, tmp_path):
    from eagle3.study import app as study

    paths = []
    for name, sizes in (("a", [(10, 1.2), (40, 1.5)]), ("b", [(10, 1.25), (40, 1.45)])):
        result = _result(name * 3, 1, sizes)
        result["overrides"] = [f"data.source={name}.jsonl", "study.size_unit=tokens"]
        result["points"][-1]["suite_tau"] = {"vicuna": sizes[-1][1]}
        paths.append(tmp_path / name / "study.json")
        paths[-1].parent.mkdir()
        paths[-1].write_text(json.dumps(result))
    cfg = make_cfg(f"paths.artifacts={tmp_path / 'artifacts'}", "tracking.enabled=false")
    folder = compare(study, cfg, paths)
    rows = [line.split(" | ") for line in (folder / "compare.md").read_text().splitlines()[4:]]
    assert [(r[0].strip("| "), r[1], r[2], r[3]) for r in rows] == [
        ("data.source=a.jsonl", "1,000", "1.200", "+0.000"),
        ("data.source=a.jsonl", "4,000", "1.500", "+0.000"),
        ("data.source=b.jsonl", "1,000", "1.250", "+0.050"),
        ("data.source=b.jsonl", "4,000", "1.450", "-0.050"),
    ]
    assert (folder / "compare.png").stat().st_size > 10_000
    other = _result("ccc", 1, [(10, 1.3), (40, 1.6)], spec="d4")
    paths.append(tmp_path / "c.json")
    paths[-1].write_text(json.dumps(other))
    with pytest.raises(Eagle3Error, match="spec d4 on \\['vicuna'\\].*not comparable"):
        compare(study, cfg, paths)
