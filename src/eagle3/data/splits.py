"""Reading the data stage's output: its tokenized splits."""

from __future__ import annotations

from pathlib import Path


def load_splits(path: str | Path):
    """The tokenized DatasetDict (splits train/val; columns id, input_ids, loss_mask)."""
    from datasets import load_from_disk

    return load_from_disk(str(Path(path) / "dataset"))
