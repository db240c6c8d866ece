"""benchmarks/drafter_asset.py: a drafter export packed into a committed int8 file and unpacked again,
and the drafter shipped that way (benchmarks/assets/drafter-<hash>.tgz, trained on an H200)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.common import compose

ROOT = Path(__file__).resolve().parents[1]


def drafter_asset(*args) -> Path:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "drafter_asset.py"), *map(str, args)],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(done.stdout.strip())


def shipped_asset() -> Path:
    (asset,) = (ROOT / "benchmarks" / "assets").glob("drafter-*.tgz")
    return asset


def shipped_recipe():
    """The shipped drafter's run as benchmarks/h200_pipeline.sh made it (fifteenth session):
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
    asset = drafter_asset("pack", export, "--out-dir", tmp_path)
    first = asset.read_bytes()
    assert (
        asset.name == "drafter-abc123.tgz"
        and drafter_asset("pack", export, "--out-dir", tmp_path) == asset
    )
    assert (
        asset.read_bytes() == first
    )  # the same export packs to the same bytes (a stable asset hash)

    out = drafter_asset("unpack", asset, tmp_path / "back")
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
    """Its name is the export hash its recipe (shipped_recipe) computes for h200_pipeline.sh's prompt
    file, and its manifest names that config's train and data outputs: a config change that moves
    them makes this fail (the asset would then be another recipe's drafter)."""
    from eagle3.outputs import data_output, export_output, train_output

    cfg = shipped_recipe()
    asset = shipped_asset()
    assert asset.name == f"drafter-{export_output(cfg).hash}.tgz"
    manifest = json.loads(
        (drafter_asset("unpack", asset, tmp_path / "shipped") / "manifest.json").read_text()
    )
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

    from eagle3.bench import tokenize_prompts
    from eagle3.engine import SpecDecoder, summarize
    from eagle3.engine.server import load_engine_drafter
    from eagle3.spec import resolve_spec
    from eagle3.suites import load_suite

    out = drafter_asset("unpack", shipped_asset(), tmp_path / "shipped")
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
    drafter, source = load_engine_drafter(cfg, smollm2, spec)
    assert source == str(out / "sglang")
    decoder = SpecDecoder(smollm2, drafter, spec)
    stats = []
    for prompt in tokenize_prompts(smollm2.tokenizer, load_suite(cfg.bench)):
        result = decoder.generate(prompt, 48)
        assert result.tokens == reference_greedy(smollm2.model, prompt, 48)
        stats.append(result.stats)
    assert summarize(stats)["tau"] > 2.0
