"""Shared pieces of the engine tests: reference greedy decoding, a drafter fitted to the
target (real TTT training on the target's own greedy rollouts, so drafts get accepted), a
SmolLM2 drafter trained by eagle3.train, specs, a chi-square p-value, and a prefill and tree
verify through the engine's lean target forward compared with HF's."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3.core.config import SpecConfig
from eagle3.core.drafter import build_drafter
from eagle3.core.spec import resolve_spec
from eagle3.engine.runners import TargetRunner
from eagle3.engine.tree import ancestor_mask

PROMPTS = [
    "Hello there, how are you doing today?",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "List three colors:",
]

SPECS = {
    "off": dict(enabled=False, depth=1, steps=0, topk=1),
    "d2": dict(enabled=True, depth=2, steps=None, topk=1),
    "d6": dict(enabled=True, depth=6, steps=None, topk=1),
    "d8s4k3": dict(enabled=True, depth=8, steps=4, topk=3),
    "d10s5k4": dict(enabled=True, depth=10, steps=5, topk=4),
    "d4": dict(enabled=True, depth=4, steps=None, topk=1),
    "d6s3k2": dict(enabled=True, depth=6, steps=3, topk=2),
    "d3": dict(enabled=True, depth=3, steps=None, topk=1),
    "tree": dict(enabled=True, depth=4, steps=2, topk=2),
}
FALSE_ALARM = 1e-3  # each chi-square test rejects a correct sampler with this probability


def spec(name: str):
    return resolve_spec(SpecConfig(**SPECS[name]))


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
    from eagle3.train.ttt import ttt_loss

    sequences = []
    for text in PROMPTS:
        prompt = target.tokenizer(text)["input_ids"]
        sequences.append(prompt + reference_greedy(target.model, prompt, rollout_tokens))
    torch.manual_seed(seed)
    drafter = build_drafter(target, dcfg)
    vocab = sorted({t for seq in sequences for t in seq})[: drafter.config.draft_vocab_size]
    d2t = torch.zeros(drafter.config.draft_vocab_size, dtype=torch.long)
    d2t[: len(vocab)] = torch.tensor(vocab) - torch.arange(len(vocab))
    t2d = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    drafter.set_vocab_map(d2t, t2d)
    batches = []
    for seq in sequences:
        ids = torch.tensor([seq])
        aux, last = target.capture(ids)
        batches.append(
            {
                "input_ids": ids,
                "loss_mask": torch.ones_like(ids),
                "aux_hidden": aux,
                "last_hidden": last,
            }
        )
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    drafter.train()
    for step in range(steps):
        loss, _ = ttt_loss(
            drafter, batches[step % len(batches)], target.model.lm_head.weight, 4, 0.8
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval().requires_grad_(False)


AGREE_VOCAB = 512
AGREE_PROMPTS = 4
AGREE_TOKENS = 32
# SmolLM2 (a real model: varied greedy continuations, no near-ties) in float32 on both engines.
# The tiny random Llama is no use here: its greedy output is one token repeated, which any drafter
# predicts, so both engines would report the trivial tau = depth.
AGREE_TARGET = (
    "target=smollm2-135m",
    "target.dtype=float32",
    f"drafter.draft_vocab_size={AGREE_VOCAB}",
)


def agree_cfg(test_root: Path, *overrides: str):
    """The SmolLM2 config the trained drafter belongs to (its prompts: the first AGREE_PROMPTS of the suite)."""
    from eagle3.core.common import compose

    return compose(
        [f"paths.root={test_root}", *AGREE_TARGET, f"bench.limit={AGREE_PROMPTS}", *overrides]
    )


def agree_prompts(target, cfg) -> list[list[int]]:
    from eagle3.bench.client import tokenize_prompts
    from eagle3.data.suites import load_suite

    return tokenize_prompts(target.tokenizer, load_suite(cfg.bench))


def trained_smollm2_drafter(test_root: Path) -> Path:
    """A drafter trained with eagle3.train (Lightning, TTT, online hidden states) on the target's own
    greedy continuations of the first vicuna prompts (SmolLM2), exported by eagle3.export; made once
    per test root."""
    from eagle3.core.artifacts import folder_lock

    out = test_root / "drafters" / "smollm2-bench-trained"
    with folder_lock(out):  # test workers started at once train it once
        if not (out / "vllm" / "config.json").exists():
            _train_smollm2_drafter(test_root, out)
    return out


def _train_smollm2_drafter(test_root: Path, out: Path) -> None:
    from support import train_settings

    from eagle3.core.drafter_io import load_trained_drafter
    from eagle3.core.target import load_target
    from eagle3.export.stage import export_drafter
    from eagle3.train.datamodule import DrafterData
    from eagle3.train.stage import fit

    train_dir = test_root / "drafters" / "smollm2-bench-train"
    cfg = agree_cfg(
        test_root,
        "train.hidden_states=online",
        "train.ttt_length=4",
        "train.max_length=160",
        "train.batch_size=4",
        "train.bucket_batches=1",
        "train.epochs=15",
        "train.lr=3e-3",
        "train.warmup_ratio=0.05",
        "train.checkpoint_every_n_steps=1000",
        "trainer.accelerator=cpu",
        "trainer.progress_bar=false",
        "tracking.enabled=false",
    )
    target = load_target(cfg.target, cfg.paths.artifacts, device="cpu")
    items = []
    for index, ids in enumerate(agree_prompts(target, cfg)):
        prompt = torch.tensor([ids])
        with torch.no_grad():
            full = target.model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=AGREE_TOKENS + 8,
                pad_token_id=0,
            )[0]
        mask = torch.zeros(len(full), dtype=torch.long)
        mask[len(ids) :] = 1
        items.append({"id": str(index), "input_ids": full, "loss_mask": mask})
    with torch.no_grad():
        predicted = torch.cat(
            [target.model(i["input_ids"][None]).logits[0].argmax(-1) for i in items]
        )
    top = predicted.bincount(minlength=target.vocab_size).topk(AGREE_VOCAB).indices.sort().values
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[top] = True
    data = DrafterData(items, items[:2], cfg.train, cfg.seed, pad_id=0)
    fit(train_settings(cfg), target, data, train_dir, top - torch.arange(AGREE_VOCAB), t2d)
    drafter = load_trained_drafter(train_dir, target, which="final")
    drafter.config.target_num_layers = target.num_layers
    export_drafter(
        cfg.export,
        cfg.target,
        drafter,
        {"note": "trained on the bench prompts' greedy continuations"},
        out,
    )


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """P(chi2 >= observed) under the null that counts ~ Multinomial(n, expected_probs)."""
    n = counts.sum()
    expected = expected_probs * n
    keep = expected > 0
    statistic = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic.double() / 2)
    )


# ---------------------------------------------------------------- lean forwards against HF's

PROMPT_LEN = 23
CACHE = 64
PARENTS = [0, 0, 0, 1, 1, 2, 3, 6]  # an 8-node tree: root, two children, ... depth 4
EXACT = dict(atol=1e-5, rtol=1e-5)


def runners(target):
    lean, hf = TargetRunner(target, CACHE), TargetRunner(target, CACHE, lean=False)
    assert lean.lean is not None and hf.lean is None
    return lean, hf


def assert_same(lean, hf, *inputs, compiled: bool = False, tolerance=EXACT) -> None:
    with torch.inference_mode():
        ours = lean._forward(*inputs, compiled=True) if compiled else lean.forward(*inputs)
        (logits, aux), (ref_logits, ref_aux) = ours, hf.forward(*inputs)
    assert logits.dtype == torch.float32 and aux.shape == ref_aux.shape
    torch.testing.assert_close(logits, ref_logits, **tolerance)
    torch.testing.assert_close(aux, ref_aux, **tolerance)
    torch.testing.assert_close(lean.kv.buffer, hf.kv.buffer, **tolerance)


def prefill_then_verify(target, kv_len, compiled: bool = False, tolerance=EXACT) -> None:
    """A causal prefill of a random prompt, then one verify of an 8-node tree after it (per-node
    positions, ancestor mask), attention reading `kv_len(needed)` cache slots; compiled: the
    verify runs the layers torch.compile'd, as a fixed-shape verify does with compile_layers."""
    lean, hf = runners(target)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (PROMPT_LEN,), generator=generator)
    positions = torch.arange(PROMPT_LEN)
    causal = torch.arange(kv_len(PROMPT_LEN))[None, :] <= positions[:, None]
    assert_same(lean, hf, ids, positions, positions, causal, tolerance=tolerance)
    parents = torch.tensor(PARENTS)
    q = parents.numel()
    depths = torch.zeros(q, dtype=torch.long)
    for node in range(1, q):
        depths[node] = depths[parents[node]] + 1
    tree = torch.zeros(q, kv_len(PROMPT_LEN + q), dtype=torch.bool)
    tree[:, :PROMPT_LEN] = True
    tree[:, PROMPT_LEN : PROMPT_LEN + q] = ancestor_mask(parents, int(depths.max()))
    tokens = torch.randint(0, target.vocab_size, (q,), generator=generator)
    assert_same(
        lean,
        hf,
        tokens,
        PROMPT_LEN + depths,
        torch.arange(PROMPT_LEN, PROMPT_LEN + q),
        tree,
        compiled=compiled,
        tolerance=tolerance,
    )
