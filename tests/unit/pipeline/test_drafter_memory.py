"""`python -m eagle3.pipeline.memory`: the memory model's parameter and optimizer parts against the
bytes a real drafter and a real AdamW step hold on tiny-llama."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.core.drafter import build_drafter
from eagle3.pipeline.memory import measure, memory_table
from eagle3.pipeline.plan import DrafterTraining, planned_target

RANKS = 4
OVERRIDES = ("target=tiny-llama", "drafter.draft_vocab_size=128", "trainer.accelerator=cpu")


def training_of(cfg) -> DrafterTraining:
    target = planned_target(cfg.target, Path(cfg.paths.artifacts))
    return DrafterTraining(target, cfg.drafter, cfg.train, cfg.trainer, cfg.pipeline.plan)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_states_equal_the_bytes_a_real_adamw_step_holds(make_cfg, tiny_target):
    cfg = make_cfg(*OVERRIDES, f"trainer.devices={RANKS}")
    table = memory_table(training_of(cfg))
    drafter = build_drafter(tiny_target, cfg.drafter).float()
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable)
    sum(p.sum() for p in trainable).backward()
    optimizer.step()
    adam = [v for p in trainable for k, v in optimizer.state[p].items() if k != "step"]
    grads = [p.grad for p in trainable]
    states = nbytes(*trainable, *grads, *adam)
    embedding = drafter.embed_tokens.weight
    head = tiny_target.output_embedding()

    assert table["parameters"] == sum(p.numel() for p in trainable)
    assert table["world"] == RANKS
    ddp, fsdp = table["ddp"], table["fsdp"]
    assert ddp["states"] * 1e9 == pytest.approx(states, rel=1e-12)
    assert ddp["DDP buckets"] * 1e9 == pytest.approx(nbytes(*grads), rel=1e-12)
    assert ddp["frozen embedding"] * 1e9 == pytest.approx(nbytes(embedding), rel=1e-12)
    assert ddp["target head"] * 1e9 == pytest.approx(nbytes(head) + 4 * head.numel(), rel=1e-12)
    assert fsdp["states"] * 1e9 == pytest.approx(states / RANKS, rel=1e-12)
    assert fsdp["frozen embedding"] * 1e9 == pytest.approx(nbytes(embedding) / RANKS, rel=1e-12)
    bf16_params = 2 * sum(p.numel() for p in drafter.parameters())
    assert fsdp["gathered unit"] * 1e9 == pytest.approx(bf16_params + nbytes(*grads) / 2, rel=1e-12)
    assert fsdp["DDP buckets"] == 0
    assert "gathered unit" not in ddp


def test_a_measured_step_is_set_against_the_one_process_total(make_cfg):
    cfg = make_cfg(*OVERRIDES, "pipeline.memory.device=cpu", "train.ttt_length=2")
    (row,) = measure(training_of(cfg), cfg.pipeline.memory.device, cfg.seed, [16])
    one_process = memory_table(
        training_of(make_cfg(*OVERRIDES, "train.max_length=16", "train.ttt_length=2"))
    )
    assert row["tokens"] == 16
    assert row["computed_gb"] == pytest.approx(sum(one_process["ddp"].values()), rel=1e-12)
    assert row["measured_gb"] is None  # peaks are read on CUDA only
