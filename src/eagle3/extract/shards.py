"""Reading the extract stage's shards: one split's samples, each read lazily from its shard (the
offline input of training; the shard layout is in eagle3.extract.stage's docstring), the plan of one
shard and the dtypes shards are stored in."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from eagle3.core.common import Eagle3Error

STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ShardPlan:
    split: str
    number: int
    first_row: int
    input_ids: list[list[int]]
    loss_masks: list[list[int]]
    ids: list[str]

    @property
    def file(self) -> str:
        return f"{self.split}/shard-{self.number:05d}.safetensors"

    @property
    def tokens(self) -> int:
        return sum(map(len, self.input_ids))


class ShardDataset(Dataset):
    """Samples of one split: {"id", "input_ids" Long[T], "loss_mask" Long[T], "aux_hidden" [T, 3H],
    "last_hidden" [T, H]} read lazily (one sample's slice, not the whole shard)."""

    def __init__(self, path: str | Path, split: str = "train"):
        self.root = Path(path)
        index_file = self.root / "index.json"
        if not index_file.exists():
            raise Eagle3Error(
                f"{self.root} has no index.json: not a finished extract output "
                "(run python -m eagle3.extract)"
            )
        index = json.loads(index_file.read_text())
        if split not in index["splits"]:
            raise Eagle3Error(
                f"split {split!r} not extracted in {self.root} (has {sorted(index['splits'])})"
            )
        self.hidden_size = index["hidden_size"]
        self.shards = index["splits"][split]
        self.samples = [
            (s, j) for s, shard in enumerate(self.shards) for j in range(shard["samples"])
        ]
        self._open: dict[int, tuple[Any, list[int], list[str]]] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def _shard(self, number: int):
        if number not in self._open:
            handle = safe_open(str(self.root / self.shards[number]["file"]), "pt")
            self._open[number] = (
                handle,
                handle.get_tensor("offsets").tolist(),
                json.loads(handle.metadata()["ids"]),
            )
        return self._open[number]

    def __getitem__(self, index: int) -> dict[str, Any]:
        shard, j = self.samples[index]
        handle, offsets, ids = self._shard(shard)
        start, end = offsets[j], offsets[j + 1]
        return {
            "id": ids[j],
            "input_ids": handle.get_slice("input_ids")[start:end].long(),
            "loss_mask": handle.get_slice("loss_mask")[start:end].long(),
            "aux_hidden": handle.get_slice("aux_hidden")[start:end],
            "last_hidden": handle.get_slice("last_hidden")[start:end],
        }

    def __getstate__(self):  # DataLoader workers reopen the files themselves
        return {**self.__dict__, "_open": {}}
