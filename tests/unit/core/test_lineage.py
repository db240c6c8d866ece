"""A drafter's lineage: the shipped drafter's recorded chain, and the chain a new export records."""

from __future__ import annotations

import json

import pytest

from eagle3.core.common import Eagle3Error
from eagle3.core.lineage import lineage_for_export, lineage_lines, lineage_of


def drafter_folder(root, export_hash: str, recipe: dict | None = None):
    """An export folder as the exporter and the asset unpacker write it: manifest.json + sglang/."""
    (root / "sglang").mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps({"stage": "export", "hash": export_hash}))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "eagle3": {"recipe": recipe or {}}}
    (root / "sglang" / "config.json").write_text(json.dumps(config))
    return root


def test_the_shipped_drafters_chain_runs_from_random_weights_to_its_export(tmp_path):
    """An export of 4f658d4f4df1 without a recorded lineage finds the preset's chain: five trainings,
    each starting from the export before it, the first from random weights, every link complete."""
    links = lineage_of(drafter_folder(tmp_path, "4f658d4f4df1") / "sglang")
    assert [link["export"] for link in links] == [
        "cd3e13167339",
        "b3a5f22b9d4d",
        "89e6b42148f4",
        "9f3df1472cc4",
        "4f658d4f4df1",
    ]
    assert [link["start"] for link in links] == ["random"] + [link["export"] for link in links[:-1]]
    assert [link["epochs"] for link in links] == [8, 6, 8, 4, 2]
    for link in links:
        assert {"data", "answers", "train", "val_tau_hat", "experiment"} <= set(link)
    # a drafter in the middle of the chain gets the chain up to itself
    assert len(lineage_of(drafter_folder(tmp_path / "mid", "89e6b42148f4"))) == 3


def test_an_export_records_its_starting_drafters_chain_and_its_own_training(make_cfg, tmp_path):
    earlier = [{"export": "aaaaaaaaaaaa", "start": "random", "epochs": 3}]
    start = drafter_folder(tmp_path / "start", "aaaaaaaaaaaa", {"lineage": earlier})
    cfg = make_cfg("target=tiny-llama", f"train.init_from={start}", "train.epochs=2")
    manifest = {"hash": "t1", "upstream": {"data": "d1"}, "counts": {"tau_hat": 2.5}}
    links = lineage_for_export(cfg.data, cfg.train, manifest, "bbbbbbbbbbbb")
    assert links[0] == earlier[0]
    assert links[1] == {
        "export": "bbbbbbbbbbbb",
        "train": "t1",
        "data": "d1",
        "answers": links[1]["answers"],
        "epochs": 2,
        "start": "aaaaaaaaaaaa",
        "val_tau_hat": 2.5,
    }
    fresh_cfg = make_cfg("target=tiny-llama")
    fresh = lineage_for_export(fresh_cfg.data, fresh_cfg.train, manifest, "cccccccccccc")
    assert [link["start"] for link in fresh] == ["random"]


def test_a_drafter_without_a_recorded_chain_is_named_in_the_error(tmp_path):
    with pytest.raises(Eagle3Error, match="no lineage recorded"):
        lineage_lines(lineage_of(drafter_folder(tmp_path, "ffffffffffff")))


def test_info_names_the_shipped_drafters_chain_by_keyword(make_cfg):
    """drafter.path=shipped: the chain ending at the asset's export hash."""
    from eagle3.tools.info import drafter_lineage

    cfg = make_cfg("drafter.path=shipped")
    links = drafter_lineage(cfg.drafter.path, cfg.shipped)
    assert links[-1]["export"] == "4f658d4f4df1" and len(links) == 5
