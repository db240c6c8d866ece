"""The draft vocabulary: the most frequent answer tokens as a map between draft and target ids
(d2t: target_id = draft_id + d2t[draft_id]; t2d: which target ids the drafter can emit)."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3.core.artifacts import load_safetensors
from eagle3.core.common import Eagle3Error
from eagle3.core.drafter_io import load_drafter


def load_vocab_map(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft_vocab], t2d bool [target_vocab]) from a data folder or the file itself."""
    path = Path(path)
    tensors = load_safetensors(path / "vocab_map.safetensors" if path.is_dir() else path)
    return tensors["d2t"], tensors["t2d"]


def vocab_map_for(
    draft_vocab: int, source: str | None, train: dict, target_vocab: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(d2t, t2d, coverage of the training answers) of `draft_vocab` (drafter.draft_vocab_size) draft
    ids: counted from them, or `source`'s (data.vocab_map_from): a data output folder, its
    vocab_map.safetensors, or any drafter export.load_drafter reads."""
    if source is None:
        return build_vocab_map(train["input_ids"], train["loss_mask"], target_vocab, draft_vocab)
    if Path(source).is_file() or (Path(source) / "vocab_map.safetensors").exists():
        d2t, t2d = load_vocab_map(source)
    else:
        drafter = load_drafter(source)
        d2t, t2d = drafter.d2t, drafter.t2d
    if (d2t.numel(), t2d.numel()) != (draft_vocab, target_vocab):
        raise Eagle3Error(
            f"data.vocab_map_from={source}: a map of {d2t.numel()} draft ids over {t2d.numel()} "
            f"target ids, this run needs {draft_vocab} (drafter.draft_vocab_size) over {target_vocab}"
        )
    return d2t, t2d, coverage_of(t2d, train["input_ids"], train["loss_mask"])


def build_vocab_map(
    input_ids: list[list[int]], loss_masks: list[list[int]], target_vocab: int, draft_vocab: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Top `draft_vocab` target ids by count under the loss mask, ascending -> (d2t, t2d, coverage).

    Unseen ids fill the rest (lowest ids first) when the data has fewer distinct tokens."""
    if draft_vocab > target_vocab:
        raise Eagle3Error(
            f"drafter.draft_vocab_size={draft_vocab} exceeds the target vocabulary {target_vocab}"
        )
    masked = torch.cat(
        [
            torch.tensor(ids, dtype=torch.long)[torch.tensor(mask, dtype=torch.bool)]
            for ids, mask in zip(input_ids, loss_masks)
        ]
    )
    counts = torch.bincount(masked, minlength=target_vocab).double()
    order = torch.argsort(-counts, stable=True)  # descending count, ties by ascending id
    chosen = order[:draft_vocab].sort().values
    d2t = chosen - torch.arange(draft_vocab)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[chosen] = True
    coverage = float(counts[chosen].sum() / counts.sum()) if counts.sum() > 0 else 0.0
    return d2t.to(torch.int64), t2d, coverage


def coverage_of(
    t2d: torch.Tensor, input_ids: list[list[int]], loss_masks: list[list[int]]
) -> float:
    hits = total = 0
    for ids, mask in zip(input_ids, loss_masks):
        ids_t, mask_t = torch.tensor(ids), torch.tensor(mask, dtype=torch.bool)
        hits += int(t2d[ids_t[mask_t]].sum())
        total += int(mask_t.sum())
    return hits / total if total else 0.0
