"""eagle3.export.shipped: a drafter export packed into a committed int8 file and unpacked again, and the
drafter shipped that way (assets/drafter-<hash>.tgz, trained on an H200): unpacked into the
artifacts, registered, announced, used by a bench sweep when nothing else was trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.core.common import compose
from eagle3.export.shipped import asset_path, pack, unpack


def shipped_asset() -> Path:
    return asset_path(compose().shipped)


def shipped_recipe():
    """The shipped drafter's run as its recipe made it on the H200 (results/smollm2-135m_h200_2026-12-02d.md):
    experiment=smollm2-h200-turns3-sampled2, under /tmp/e3 (train.init_from, a path below
    paths.root, is part of the train stage's hash)."""
    return compose(
        [
            "experiment=smollm2-h200-turns3-sampled2",
            "paths.root=/tmp/e3",
            "data.source=/tmp/e3/turns3s2.jsonl",
        ]
    )


def test_pack_then_unpack_keeps_each_weight_within_half_its_rows_step(tmp_path):
    export = tmp_path / "export"
    (export / "sglang").mkdir(parents=True)
    torch.manual_seed(0)
    weights = {
        "fc.weight": torch.randn(8, 12) * torch.logspace(-3, 1, 8)[:, None],  # rows 10,000x apart
        "empty.weight": torch.zeros(2, 5),
        "norm.weight": torch.randn(12),
        "d2t": torch.arange(6) * 3,
        "t2d": torch.rand(10) > 0.5,
    }
    save_file(weights, export / "sglang" / "model.safetensors")
    (export / "sglang" / "config.json").write_text('{"draft_vocab_size": 6}')
    (export / "manifest.json").write_text('{"hash": "abc123"}')
    asset = pack(export, tmp_path)
    first = asset.read_bytes()
    assert asset.name == "drafter-abc123.tgz" and pack(export, tmp_path) == asset
    assert (
        asset.read_bytes() == first
    )  # the same export packs to the same bytes (a stable asset hash)

    out = unpack(asset, tmp_path / "back")
    back = load_file(out / "sglang" / "model.safetensors")
    assert back.keys() == weights.keys()
    for name in ("empty.weight", "norm.weight", "d2t", "t2d"):
        assert torch.equal(back[name], weights[name])
    # a scale per row: with one scale for the tensor the small rows would lose every digit
    step = weights["fc.weight"].abs().amax(dim=1, keepdim=True) / 127
    error = (back["fc.weight"] - weights["fc.weight"]).abs()
    assert (error <= 0.5001 * step).all() and (error > 0).any()
    assert (out / "sglang" / "config.json").read_text() == '{"draft_vocab_size": 6}'
    assert json.loads((out / "manifest.json").read_text()) == {"hash": "abc123"}


def test_shipped_drafter_is_its_recipes_export(tmp_path):
    """Its name is the export hash its recipe (shipped_recipe) computes for the H200 run's prompt
    file, and its manifest names that config's train and data outputs: a config change that moves
    them makes this fail (the asset would then be another recipe's drafter)."""
    from eagle3.core.outputs import data_output, export_output, train_output

    cfg = shipped_recipe()
    asset = shipped_asset()
    assert asset.name == f"drafter-{export_output(cfg).hash}.tgz"
    manifest = json.loads((unpack(asset, tmp_path / "shipped") / "manifest.json").read_text())
    assert manifest["upstream"] == {"train": train_output(cfg).hash}
    assert manifest["recipe"]["data_hash"] == data_output(cfg).hash


@pytest.mark.slow
def test_shipped_drafter_drafts_smollm2_losslessly_on_prompts_it_never_saw(
    smollm2, test_root, tmp_path
):
    """Unpacked and loaded as the server loads it, in float32 on the first vicuna prompts (not in its
    training data): the output is SmolLM2's greedy decode, and drafts are accepted as a trained
    drafter's are (an untrained one, or weights under names the engine ignores, give tau ~1)."""
    from engine_helpers import reference_greedy

    from eagle3.bench.client import tokenize_prompts
    from eagle3.core.spec import resolve_spec
    from eagle3.data.suites import load_suite
    from eagle3.engine import DecodeRequest, SpecDecoder, summarize
    from eagle3.engine.service import drafter_source_for, load_engine_drafter

    out = unpack(shipped_asset(), tmp_path / "shipped")
    cfg = compose(
        [
            f"paths.root={test_root}",
            "target=smollm2-135m",
            "target.dtype=float32",
            f"drafter.path={out}",
            "spec=d32s4k8",
            "bench.limit=2",
        ]
    )
    spec = resolve_spec(cfg.spec)
    drafter, source = load_engine_drafter(drafter_source_for(cfg), smollm2, spec)
    assert source == str(out / "sglang")
    decoder = SpecDecoder(smollm2, drafter, spec)
    stats = []
    for prompt in tokenize_prompts(smollm2.tokenizer, load_suite(cfg.bench)):
        result = decoder.generate(DecodeRequest(prompt, 48))
        assert result.tokens == reference_greedy(smollm2.model, prompt, 48)
        stats.append(result.stats)
    assert summarize(stats)["tau"] > 2.0


# ---------------------------------------------------------------- chosen, unpacked, registered


def test_the_shipped_drafter_is_chosen_only_when_nothing_else_is(make_cfg, own_artifacts):
    from eagle3.core.outputs import export_output
    from eagle3.export.shipped import unpacked, uses_shipped_drafter

    def cfg(*overrides):
        return make_cfg(f"paths.artifacts={own_artifacts}", *overrides)

    def uses_shipped(c) -> bool:
        return uses_shipped_drafter(
            c.drafter.path, c.shipped, c.target, lambda: export_output(c).complete
        )

    assert uses_shipped(cfg())  # SmolLM2, nothing trained for this config, no drafter.path
    assert not uses_shipped(cfg("target=tiny-llama"))  # another target
    assert not uses_shipped(cfg("drafter.path=/some/export"))
    assert not uses_shipped(cfg("shipped.use=never"))
    assert uses_shipped(cfg("target=tiny-llama", "drafter.path=shipped"))  # asked for by name ...
    with pytest.raises(Exception, match="trained for target smollm2-135m, not tiny-llama"):
        refused = cfg("target=tiny-llama", "drafter.path=shipped")
        unpacked(
            refused.shipped, refused.target, refused.paths.artifacts
        )  # ... and refused, saying why


def test_unpacked_once_registered_once_announced_once(make_cfg, own_artifacts, capsys):
    """A stage folder with the export's lineage, one model version in the registry however often it
    is asked for, one announcement line per process."""
    from mlflow.tracking import MlflowClient

    from eagle3.export import shipped

    shipped.announced.clear()
    cfg = make_cfg(f"paths.artifacts={own_artifacts}")
    sections = (cfg.shipped, cfg.target, cfg.paths.artifacts, cfg.tracking, cfg.export)
    folder = shipped.shipped_drafter(*sections)
    first_write = (folder / "sglang" / "model.safetensors").stat().st_mtime_ns
    assert (
        shipped.shipped_drafter(*sections) == folder == own_artifacts / "shipped" / "4f658d4f4df1"
    )
    assert (folder / "sglang" / "model.safetensors").stat().st_mtime_ns == first_write
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["stage"] == "shipped" and manifest["complete"]
    assert manifest["upstream"] == {"export": "4f658d4f4df1", "train": "f61561dcab41"}
    assert manifest["recipe"]["data_hash"] == "b0d987ab5650"
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    (version,) = client.search_model_versions("name='eagle3-smollm2-135m'")
    assert version.tags["shipped_drafter"] == "4f658d4f4df1"
    assert float(version.tags["tau_hat"]) == pytest.approx(3.4878, abs=1e-4)
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        "using the shipped drafter 4f658d4f4df1; train your own with `python -m eagle3.pipeline` "
        "(registered as models:/eagle3-smollm2-135m/1)"
    ]
    downloaded = shipped_registered_copy(cfg, own_artifacts)
    assert (
        load_file(downloaded / "sglang" / "model.safetensors").keys()
        == load_file(folder / "sglang" / "model.safetensors").keys()
    )


def shipped_registered_copy(cfg, artifacts) -> Path:
    """The registered version as drafter.path=models:/... downloads it."""
    from eagle3.core.drafter_io import download_registered

    return download_registered(
        "models:/eagle3-smollm2-135m/1", cfg.tracking.uri, artifacts / "registry" / "shipped"
    )


@pytest.mark.slow
def test_a_sweep_on_the_shipped_drafter(test_root, own_artifacts, tmp_path, empty_store):
    """`python -m eagle3.bench -m spec.depth=3,2` with nothing trained: the shipped drafter is
    announced, registered and used; each child run has its settings as params and its measurements
    (medians of the repeats, their ranges) as metrics; the experiment opens as a model-development
    experiment; the last lines compare each depth with spec=off."""
    import shutil
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    (tmp_path / "mlruns").mkdir()
    shutil.copyfile(empty_store, tmp_path / "mlruns" / "mlflow.db")  # a new store, made once
    uri = f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    argv = [
        *(sys.executable, "-m", "eagle3.bench", "-m", "spec.depth=3,2"),
        *("bench.limit=1", "bench.max_new_tokens=24", "bench.warmup=0", "bench.repeats=2"),
        f"paths.root={test_root}",
        f"paths.artifacts={own_artifacts}",
        f"tracking.uri={uri}",
        f"tracking.artifact_location={tmp_path}/mlruns/art",
        f"hydra.sweep.dir={tmp_path}/sweep",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    announced = [line for line in out.stdout.splitlines() if "shipped drafter" in line]
    assert announced == [
        "using the shipped drafter 4f658d4f4df1; train your own with `python -m eagle3.pipeline` "
        "(registered as models:/eagle3-smollm2-135m/1)"
    ]
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("eagle3")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    (version,) = client.search_model_versions("name='eagle3-smollm2-135m'")
    assert version.tags["shipped_drafter"] == "4f658d4f4df1"
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("stage") == "bench-sweep"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(c.data.params["job.spec"] for c in children) == ["d2", "d3"]
    for child in children:
        params, metrics = child.data.params, child.data.metrics
        assert params["job.drafter"] == "4f658d4f4df1" and params["job.batch_size"] == "1"
        assert params["job.max_new_tokens"] == "24" and params["job.repeats"] == "2"
        assert params["job.engine_version"].startswith("eagle3 ") and params["job.hardware"]
        assert not {"batch_size", "max_new_tokens", "depth", "repeats"} & set(metrics)
        assert metrics["tokens_per_s_min"] <= metrics["tokens_per_s"] <= metrics["tokens_per_s_max"]
        assert metrics["speedup_min"] <= metrics["speedup"] <= metrics["speedup_max"]
        assert metrics["accept_length"] > 1.2  # a trained drafter's drafts are accepted
        history = client.get_metric_history(child.info.run_id, "tokens_per_s_pass")
        assert len(history) == 2
        assert child.data.tags["vs_spec_off"] in ("faster", "slower", "tie")
    files = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"summary.md", "summary.csv", "verdict.txt", "speedup.png"} <= files
    lines = out.stdout.strip().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("  spec=off: "))
    assert lines[first].endswith("measured in this sweep")
    assert lines[first + 1].startswith("  d3: ") and lines[first + 2].startswith("  d2: ")
    # two passes of a short suite: too few to name a winner (bench.winner_min_repeats)
    assert lines[first + 3].startswith(
        ("no winner: the sweep is too small", "no shape beat spec=off")
    )
    assert lines[-1].startswith("cost model: ") and first + 4 == len(lines) - 1
