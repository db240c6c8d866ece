"""train.compile_unroll on the tiny target: the torch.compile'd TTT unroll (Inductor's CPU backend
here) against the eager one."""

from __future__ import annotations

import pytest
import torch
from support import ttt_case

from eagle3.train.ttt import compiled_unroll, ttt_loss, unroll


@pytest.fixture
def case(make_cfg, tiny_target):
    return ttt_case(make_cfg("target=tiny-llama", "drafter.draft_vocab_size=256"), tiny_target)


def test_compiled_unroll_equals_the_eager_one_across_lengths(case, tiny_target):
    """train.compile_unroll: the compiled unroll (dynamic shapes: one compile for every length) gives the
    eager unroll's logits and gradients, on three lengths and two batch sizes; the train stage's validation
    and batches of one add no compile."""
    drafter, _, _ = case
    compiled = compiled_unroll()
    for batch, length in ((2, 17), (2, 29), (3, 40)):
        ids = torch.randint(0, tiny_target.vocab_size, (batch, length))
        aux, _ = tiny_target.capture(ids)
        results = []
        for run in (unroll, compiled):
            drafter.zero_grad()
            logits = run(drafter, ids, aux, 3)
            sum((step.float() ** 2).mean() for step in logits).backward()
            grads = [p.grad.clone() for p in drafter.parameters() if p.requires_grad]
            results.append(logits + grads)
        for eager, fused in zip(*results):
            torch.testing.assert_close(eager, fused, rtol=1e-4, atol=1e-5)
    # the train stage's other calls compile nothing more: validation (no grad) and a batch of one
    _, batch, lm_head = case
    ttt_loss(drafter, batch, lm_head, 3, 0.8, compile_unroll=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    ttt_loss(drafter, {k: v[:1] for k, v in batch.items()}, lm_head, 3, 0.8, compile_unroll=True)
    with torch.no_grad():
        ttt_loss(drafter, batch, lm_head, 3, 0.8, compile_unroll=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs > 0
