"""train.hidden_states=engine: training fed by a vLLM server that captures the target's hidden states
as it runs the target (tensor parallel over its own GPUs), no shards on disk. The server is the one
`extract.backend=vllm` starts (extract.engine, extract.tensor_parallel_size: the same command, aux
layers and final norm), and every item is what the offline path reads from that backend's shards: the
aux states [T, 3H] and the normed final state [T, H] at extract.dtype, the data stage's token ids and
loss mask. The connector hands each request's states over as one file that is read and deleted at once.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from torch.utils.data import Dataset

from eagle3.core.config import ExtractConfig
from eagle3.extract.shards import STORAGE_DTYPES, ShardPlan
from eagle3.extract.vllm_capture import CaptureCommand, TargetShape, VllmCapture


class EngineStates(Dataset):
    """Rows of one data split with their hidden states captured by a started server on access."""

    def __init__(self, split_rows, split: str, capture: VllmCapture, dtype: str):
        self.rows, self.split, self.capture = split_rows, split, capture
        self.dtype = STORAGE_DTYPES[dtype]
        self.lengths = [len(ids) for ids in split_rows["input_ids"]]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        row = self.rows[index]
        plan = ShardPlan(
            self.split, 0, index, [list(row["input_ids"])], [list(row["loss_mask"])], [row["id"]]
        )
        tensors = self.capture.shard(plan, self.dtype)
        return {
            "id": row["id"],
            "input_ids": tensors["input_ids"].long(),
            "loss_mask": tensors["loss_mask"].long(),
            "aux_hidden": tensors["aux_hidden"],
            "last_hidden": tensors["last_hidden"],
        }

    def __getstate__(self):
        raise TypeError(
            "train.hidden_states=engine reads states in the training process: use "
            "trainer.num_workers=0"
        )


@contextlib.contextmanager
def capture_server(
    command: CaptureCommand, ecfg: ExtractConfig, shape: TargetShape
) -> Iterator[VllmCapture]:
    """The vLLM capture server of extract.backend=vllm for the target of `shape`, started, stopped
    on exit; its log and per-request files in a temporary folder of this node, removed after."""
    with tempfile.TemporaryDirectory(prefix="eagle3-engine-states-") as folder:
        with VllmCapture(command, ecfg, shape, Path(folder)) as capture:
            yield capture
