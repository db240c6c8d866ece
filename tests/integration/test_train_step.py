"""The training step on the tiny random target: length buckets and a step that reads nothing back to
the host give the eager step's losses; throughput in tokens per device; the optimizer's implementation options."""

from __future__ import annotations

import random

import lightning as L
import pytest
import torch
from support import BASE, peaked_target, step_recorder, synthetic_fit

from eagle3.core.common import Eagle3Error, compose
from eagle3.core.outputs import train_output
from eagle3.train.callbacks import busy_seconds
from eagle3.train.datamodule import check_buckets, collate
from eagle3.train.drafter_module import DrafterModule, adamw_options

# the synthetic rows are 10..24 tokens and train.max_length is 32: every bucket is met
BUCKETS = "train.length_buckets=[12,16,24]"
QUIET = ["train.checkpoint_every_n_steps=1000", "train.val_every_n_epochs=9"]


@pytest.fixture(scope="module")
def target(test_root):
    return peaked_target(compose([f"paths.root={test_root}", "target=tiny-llama"]))


class Shapes(L.Callback):
    def __init__(self):
        self.lengths, self.tokens = [], 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.lengths.append(batch["input_ids"].shape[1])
        self.tokens += int(batch["attention_mask"].sum())


def test_bucketed_step_without_host_reads_gives_the_eager_losses(make_cfg, target, tmp_path):
    """54 steps (9 epochs of 6 batches): the batches padded to the length buckets, the fused AdamW,
    give the same loss at every step as batches padded to their longest row with torch's default
    AdamW, within float32 rounding (padding is masked; rel 1e-4 holds 54 steps of Adam at lr 3e-3).
    The bucketed run meets only the buckets' lengths, the other a length per batch."""
    runs = {}
    for name, options in (("eager", []), ("bucketed", [BUCKETS, "train.adamw=fused"])):
        recorder, shapes = step_recorder(), Shapes()
        # checkpoints and validation once, at the end: the steps are what is compared
        cfg = make_cfg(*BASE, "train.epochs=9", *QUIET, *options)
        synthetic_fit(cfg, tmp_path / name, [recorder, shapes], target)
        runs[name] = (recorder.train_loss, shapes.lengths)
    eager, bucketed = runs["eager"][0], runs["bucketed"][0]
    assert len(eager) == len(bucketed) == 54
    assert bucketed == pytest.approx(eager, rel=1e-4)
    assert eager[-1] < 0.7 * eager[0]  # it learned: the comparison is not between two flat lines
    assert set(runs["bucketed"][1]) <= {12, 16, 24, 32}
    assert len(set(runs["eager"][1])) > len(set(runs["bucketed"][1]))


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def test_training_step_reads_nothing_back_to_the_host(make_cfg, target, tmp_path, monkeypatch):
    """Every tensor read to the host (item, tolist, cpu, bool/float/int of a tensor) inside
    DrafterModule.training_step is counted: none at the steps whose metrics nobody reads, some at
    Lightning's log steps (the counter works), where the NaN check and the metrics are read."""
    reads_by_step, current = {}, []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(tensor, *args, **kwargs):
            if current:
                reads_by_step[current[-1]] = reads_by_step.get(current[-1], 0) + 1
            return original(tensor, *args, **kwargs)

        return read

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    step = DrafterModule.training_step

    def counted_step(module, batch, batch_idx):
        current.append(module.global_step)
        try:
            return step(module, batch, batch_idx)
        finally:
            current.pop()

    monkeypatch.setattr(DrafterModule, "training_step", counted_step)
    cfg = make_cfg(*BASE, "train.epochs=2", "trainer.log_every_n_steps=5", BUCKETS)
    synthetic_fit(cfg, tmp_path / "run", target=target)
    logged = {4, 9, 11}  # Lightning's log steps 5 and 10, the fit's last (12 steps)
    assert {s for s in range(12) if reads_by_step.get(s, 0) > 0} == logged


def test_collate_pads_to_the_length_buckets():
    items = [
        {"id": i, "input_ids": torch.arange(1, n + 1), "loss_mask": torch.ones(n, dtype=torch.long)}
        for i, n in enumerate((3, 5))
    ]
    batch = collate(items, max_length=12, pad_id=0, buckets=[4, 8])
    assert batch["input_ids"].shape == (2, 8) and batch["tokens"] == 8
    assert batch["attention_mask"].sum(1).tolist() == [3, 5]
    assert batch["loss_mask"].sum().item() == 8
    assert collate(items[:1], max_length=12, pad_id=0, buckets=[4, 8])["input_ids"].shape == (1, 4)
    assert collate(items, max_length=12, pad_id=0, buckets=[2, 4])["input_ids"].shape == (2, 12)
    assert collate(items, max_length=4, pad_id=0, buckets=[8])["input_ids"].shape == (2, 4)
    assert collate(items, max_length=12, pad_id=0)["input_ids"].shape == (2, 5)
    for bad in ([8, 4], [0, 4], [], [4, 4]):
        with pytest.raises(Eagle3Error, match=r"train.length_buckets=.*ascending"):
            check_buckets(bad)


def test_throughput_counts_real_tokens_per_device(make_cfg, target, tmp_path, caplog):
    """train/tokens_per_s_per_device times the fit's seconds is exactly the real (unpadded) tokens of
    every step; the padding share is the rest of the padded batches; GPU busy says n/a on a CPU."""
    shapes = Shapes()
    cfg = make_cfg(*BASE, "train.epochs=1", "trainer.log_every_n_steps=3", BUCKETS)
    with caplog.at_level("INFO", logger="eagle3"):
        result = synthetic_fit(cfg, tmp_path / "run", [shapes], target)
    seconds = result["train/seconds"]
    assert round(result["train/tokens_per_s_per_device"] * seconds) == shapes.tokens
    assert result["train/tokens_per_s"] == pytest.approx(result["train/tokens_per_s_per_device"])
    assert len(shapes.lengths) == 6  # 24 rows in batches of 4
    padded = sum(4 * n for n in shapes.lengths)
    assert result["train/padding_share"] == pytest.approx(1 - shapes.tokens / padded)
    assert "train/gpu_busy_pct" not in result
    messages = [r.getMessage() for r in caplog.records]
    assert sum("tokens/s per device (" in m for m in messages if m.startswith("train: step")) == 2
    assert any(m.endswith("GPU busy n/a on CPU") for m in messages)


def test_busy_seconds_is_the_union_of_intervals():
    """Against a brute-force count over a grid of 0.5 µs cells (overlapping and nested intervals)."""
    rng = random.Random(0)
    intervals = []
    for _ in range(40):
        start = rng.randrange(0, 400) / 2
        intervals.append((start, start + rng.randrange(1, 60) / 2))
    cells = {c for start, end in intervals for c in range(int(start * 2), int(end * 2))}
    assert busy_seconds(intervals) == pytest.approx(len(cells) / 2)
    assert busy_seconds([]) == 0


def test_adamw_options_and_hash(make_cfg):
    """train.adamw: torch's default, foreach or fused (capturable with a tensor learning rate on a GPU);
    a bad value names the key; the speed settings leave the train hash alone."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert adamw_options("default", 1e-3, cpu) == {"lr": 1e-3}
    assert adamw_options("auto", 1e-3, cpu) == {"lr": 1e-3}
    assert adamw_options("fused", 1e-3, cpu) == {"lr": 1e-3, "fused": True}
    assert adamw_options("foreach", 1e-3, cpu) == {"lr": 1e-3, "foreach": True}
    with pytest.raises(Eagle3Error, match="train.adamw='adam'"):
        adamw_options("adam", 1e-3, cpu)
    if torch.cuda.is_available():
        options = adamw_options("auto", 1e-3, cuda)
        assert options["fused"] and options["capturable"] and torch.is_tensor(options["lr"])
    hashes = {
        train_output(make_cfg(*BASE, *options)).hash
        for options in (
            [],
            [BUCKETS],
            ["train.adamw=fused"],
            ["trainer.gpu_busy_steps=0"],
        )
    }
    assert len(hashes) == 1
