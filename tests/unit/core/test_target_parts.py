"""Offline training and export read only the target's embedding, head and final norm by name from
its safetensors files: the same tensors as the whole model's, and a target whose other shards are
unreadable still trains offline and exports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from support import target_folder_overrides

from eagle3.core.target import load_target, resolve_target_path
from eagle3.core.target_parts import INDEX, load_target_parts
from eagle3.data import stage as data
from eagle3.export import stage as export
from eagle3.extract import stage as extract
from eagle3.train import stage as train


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-llama"])  # sharded and untied; one file, tied
def test_parts_equal_the_whole_models_tensors(make_cfg, name):
    cfg = make_cfg(f"target={name}")
    parts = load_target_parts(cfg.target, cfg.paths.artifacts)
    whole = load_target(cfg.target, cfg.paths.artifacts, device="cpu")
    assert torch.equal(parts.input_embedding(), whole.model.get_input_embeddings().weight)
    assert torch.equal(parts.output_embedding(), whole.model.get_output_embeddings().weight)
    assert torch.equal(parts.norm, whole.model.model.norm.weight)
    assert parts.input_embedding().dtype == whole.model.dtype
    shape = (parts.hidden_size, parts.vocab_size, parts.num_layers, parts.aux_layer_ids)
    assert shape == (whole.hidden_size, whole.vocab_size, whole.num_layers, whole.aux_layer_ids)
    assert parts.config.max_position_embeddings == whole.config.max_position_embeddings


def test_offline_training_and_export_never_read_the_decoder_shards(
    make_cfg, test_root, tmp_path, one_thread
):
    folder = tmp_path / "target"
    shutil.copytree(
        resolve_target_path(make_cfg("target=tiny-moe").target, test_root / "artifacts"), folder
    )
    artifacts = tmp_path / "artifacts"
    cfg = make_cfg(*target_folder_overrides(artifacts, folder))
    data.run(cfg)
    extract.run(cfg)
    before = load_file(str(train.run(cfg).path / "drafter.safetensors"))
    shutil.rmtree(outputs_train_path(cfg))

    # fault simulation: every shard without the embedding, head or final norm is overwritten with
    # junk (tests run as root here, so a chmod would not stop the reads)
    weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    needed = {
        weight_map[n] for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")
    }
    damaged = sorted(set(weight_map.values()) - needed)
    assert len(damaged) >= 2
    for shard in damaged:
        (folder / shard).write_bytes(b"unreadable")
    with pytest.raises(SafetensorError, match="deserializing header"):
        load_target(
            cfg.target, cfg.paths.artifacts, device="cpu"
        )  # the whole model no longer loads

    out = train.run(cfg)
    after = load_file(str(out.path / "drafter.safetensors"))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    exported = load_file(str(export.run(cfg).path / "sglang" / "model.safetensors"))
    best = load_file(str(out.path / "best.safetensors"))
    assert torch.equal(exported["fc.weight"], best["fc.weight"])
    assert torch.equal(exported["lm_head.weight"], best["lm_head.weight"])


def outputs_train_path(cfg) -> Path:
    from eagle3.core.outputs import train_output

    return train_output(cfg).path
