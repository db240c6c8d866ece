"""Shared pieces of the engine tests: reference greedy decoding, a drafter fitted to the
target (real TTT training on the target's own greedy rollouts, so drafts get accepted),
specs and a chi-square p-value."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from eagle3.drafter import build_drafter
from eagle3.spec import resolve_spec

PROMPTS = ["Hello there, how are you doing today?", "The capital of France is",
           "def fibonacci(n):\n    ", "List three colors:"]

SPECS = {
    "off": dict(enabled=False, depth=1, steps=0, topk=1),
    "d2": dict(enabled=True, depth=2, steps=None, topk=1),
    "d6": dict(enabled=True, depth=6, steps=None, topk=1),
    "d8s4k3": dict(enabled=True, depth=8, steps=4, topk=3),
    "d10s5k4": dict(enabled=True, depth=10, steps=5, topk=4),
}


def spec(name: str):
    return resolve_spec(OmegaConf.create(SPECS[name]))


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy decode: full forward over the growing sequence, argmax of the last row."""
    ids = torch.tensor([prompt], device=model.device)
    out = []
    for _ in range(n):
        token = int(model(ids).logits[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]], device=ids.device)], dim=1)
    return out


def fitted_drafter(target, dcfg, rollout_tokens: int = 96, steps: int = 150, seed: int = 0):
    """A drafter trained with the real TTT loss on the target's greedy rollouts of PROMPTS."""
    from eagle3.ttt import ttt_loss
    sequences = []
    for text in PROMPTS:
        prompt = target.tokenizer(text)["input_ids"]
        sequences.append(prompt + reference_greedy(target.model, prompt, rollout_tokens))
    torch.manual_seed(seed)
    drafter = build_drafter(target, dcfg)
    vocab = sorted({t for seq in sequences for t in seq})[:drafter.config.draft_vocab_size]
    d2t = torch.zeros(drafter.config.draft_vocab_size, dtype=torch.long)
    d2t[:len(vocab)] = torch.tensor(vocab) - torch.arange(len(vocab))
    t2d = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    drafter.set_vocab_map(d2t, t2d)
    batches = []
    for seq in sequences:
        ids = torch.tensor([seq])
        aux, last = target.capture(ids)
        batches.append({"input_ids": ids, "loss_mask": torch.ones_like(ids), "aux_hidden": aux, "last_hidden": last})
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    drafter.train()
    for step in range(steps):
        loss, _ = ttt_loss(drafter, batches[step % len(batches)], target.model.lm_head.weight, 4, 0.8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval().requires_grad_(False)


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """P(chi2 >= observed) under the null that counts ~ Multinomial(n, expected_probs)."""
    n = counts.sum()
    expected = expected_probs * n
    keep = expected > 0
    statistic = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic.double() / 2))
