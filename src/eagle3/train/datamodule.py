"""What training reads: token datasets (online) or hidden-state shards (offline), length-bucketed
deterministic batches sharded over ranks and resumable mid-epoch, and the Lightning DataModule."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from eagle3.core.artifacts import StageOutput
from eagle3.core.common import Eagle3Error
from eagle3.core.config import TrainConfig
from eagle3.data.splits import load_splits
from eagle3.extract.shards import ShardDataset


class TokenDataset(Dataset):
    """Online mode: rows of the data stage's split (id, input_ids, loss_mask) as tensors."""

    def __init__(self, split):
        self.split = split
        self.lengths = [len(ids) for ids in split["input_ids"]]

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> dict:
        row = self.split[index]
        return {
            "id": row["id"],
            "input_ids": torch.tensor(row["input_ids"]),
            "loss_mask": torch.tensor(row["loss_mask"]),
        }


def item_lengths(dataset) -> list[int]:
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        lengths = [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    return list(lengths)


def padded_length(longest: int, max_length: int, buckets=None) -> int:
    """The batch's length: the longest item (at most max_length), raised to the first of the
    ascending `buckets` that holds it (max_length past the last), so a run meets a few fixed shapes."""
    longest = min(longest, max_length)
    if not buckets:
        return longest
    return min(next((b for b in buckets if b >= longest), max_length), max_length)


def check_buckets(buckets) -> list[int] | None:
    """train.length_buckets: null or ascending positive lengths."""
    if buckets is None:
        return None
    buckets = list(buckets)
    if not buckets or any(int(b) != b or b < 1 for b in buckets) or buckets != sorted(set(buckets)):
        raise Eagle3Error(
            f"train.length_buckets={buckets}: use null or ascending positive token counts, e.g. "
            "[256,512,1024,2048]"
        )
    return [int(b) for b in buckets]


def collate(items: list[dict], max_length: int, pad_id: int, buckets=None) -> dict:
    """Right-pad to the longest item (truncated to max_length), or to its length bucket. Padding has
    loss_mask 0 and, with causal attention, is never seen by real tokens. `tokens` counts the batch's
    real (unpadded) tokens, on the host, for the throughput."""
    real = [min(len(item["input_ids"]), max_length) for item in items]
    length = padded_length(max(real), max_length, buckets)
    batch: dict = {"id": [item["id"] for item in items], "tokens": sum(real)}
    fills = {"input_ids": pad_id, "loss_mask": 0, "aux_hidden": 0, "last_hidden": 0}
    for key, fill in fills.items():
        if key not in items[0]:
            continue
        rows = [item[key][:length] for item in items]
        padded = torch.full((len(rows), length, *rows[0].shape[1:]), fill, dtype=rows[0].dtype)
        for i, row in enumerate(rows):
            padded[i, : len(row)] = row
        batch[key] = padded
    batch["attention_mask"] = (torch.arange(length)[None, :] < torch.tensor(real)[:, None]).long()
    return batch


class BucketBatchSampler:
    """Length-bucketed batches in one deterministic order per (seed, epoch), this rank's share;
    `resume(epoch, done)` skips the batches a resumed run already trained on."""

    def __init__(
        self,
        lengths: list[int],
        batch_size: int,
        bucket_batches: int,
        seed: int,
        shuffle: bool,
        rank: int = 0,
        world: int = 1,
    ):
        self.lengths, self.batch_size, self.bucket_batches = lengths, batch_size, bucket_batches
        self.seed, self.shuffle, self.rank, self.world = seed, shuffle, rank, world
        self.epoch, self.skip = 0, {}
        self.sampler = (
            self  # Lightning calls set_epoch on `batch_sampler.sampler`, not on the batch sampler
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume(self, epoch: int, done: int) -> None:
        # Lightning creates the first iterator of a resumed fit before it calls set_epoch
        self.epoch, self.skip = epoch, {epoch: done}

    def all_batches(self, epoch: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        count = len(self.lengths)
        order = (
            torch.randperm(count, generator=generator).tolist()
            if self.shuffle
            else list(range(count))
        )
        span = self.batch_size * self.bucket_batches
        batches = []
        for start in range(0, count, span):
            bucket = sorted(order[start : start + span], key=lambda i: self.lengths[i])
            batches += [
                bucket[i : i + self.batch_size] for i in range(0, len(bucket), self.batch_size)
            ]
        if self.shuffle:
            batches = [
                batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()
            ]
        return batches

    def rank_batches(self, epoch: int) -> list[list[int]]:
        batches = self.all_batches(epoch)
        per_rank = math.ceil(len(batches) / self.world)
        batches = (batches * self.world)[: per_rank * self.world]  # every rank takes as many steps
        return batches[self.rank * per_rank : (self.rank + 1) * per_rank]

    def __len__(self) -> int:
        return math.ceil(len(self.all_batches(0)) / self.world)

    def __iter__(self):
        batches = self.rank_batches(self.epoch)
        yield from batches[self.skip.pop(self.epoch, 0) :]


class DrafterData(L.LightningDataModule):
    """Train/val loaders over either shards (offline) or token rows (online)."""

    def __init__(
        self,
        train_set: Dataset,
        val_set: Dataset,
        tcfg: TrainConfig,
        seed: int,
        pad_id: int,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        super().__init__()
        self.train_set, self.val_set, self.tcfg = train_set, val_set, tcfg
        self.seed, self.pad_id, self.num_workers = seed, pad_id, num_workers
        self.pin_memory = pin_memory
        self.buckets = check_buckets(tcfg.length_buckets)
        self.train_sampler: BucketBatchSampler | None = None
        self.pending_resume: tuple[int, int] | None = None

    def setup(self, stage: str) -> None:
        self.train_sampler = self.bucket_sampler(self.train_set, shuffle=True)
        self.val_sampler = self.bucket_sampler(self.val_set, shuffle=False)
        if self.pending_resume:
            self.train_sampler.resume(*self.pending_resume)

    def bucket_sampler(self, dataset: Dataset, shuffle: bool) -> BucketBatchSampler:
        """This rank's length-bucketed batches of `dataset` (train.batch_size, train.bucket_batches)."""
        rank, world = (
            (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        )
        return BucketBatchSampler(
            item_lengths(dataset),
            self.tcfg.batch_size,
            self.tcfg.bucket_batches,
            self.seed,
            shuffle=shuffle,
            rank=rank,
            world=world,
        )

    def loader(self, dataset, sampler) -> DataLoader:
        return DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,  # page-locked batches: the copy to the GPU runs asynchronously
            collate_fn=functools.partial(
                collate, max_length=self.tcfg.max_length, pad_id=self.pad_id, buckets=self.buckets
            ),
        )

    def train_dataloader(self) -> DataLoader:
        return self.loader(self.train_set, self.train_sampler)

    def val_dataloader(self) -> DataLoader:
        return self.loader(self.val_set, self.val_sampler)

    def state_dict(self) -> dict:
        """The data position: batches of the current epoch already trained on (saved in checkpoints)."""
        done = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        epoch = self.trainer.current_epoch
        if self.train_sampler is not None and done >= len(
            self.train_sampler
        ):  # saved at the epoch's end
            epoch, done = epoch + 1, 0
        return {"epoch": epoch, "batches_done": done}

    def load_state_dict(self, state: dict) -> None:
        self.pending_resume = (state["epoch"], state["batches_done"])
        if self.train_sampler is not None:
            self.train_sampler.resume(*self.pending_resume)


def datasets_for(
    tcfg: TrainConfig, states_dtype: str, data_dir: Path, shards: StageOutput | None, capture=None
) -> tuple[Dataset, Dataset]:
    """Train and val datasets: states from `shards` (offline), the target (online) or, with
    train.hidden_states=engine, `capture` (a started server) at `states_dtype` (extract.dtype)."""
    train_set, val_set = split_datasets(tcfg.hidden_states, states_dtype, data_dir, shards, capture)
    return first_rows(train_set, tcfg.limit), val_set


def first_rows(dataset: Dataset, limit: int | None) -> Dataset:
    """The first `limit` items of `dataset` (all when null), lengths kept for bucketing."""
    if limit is None:
        return dataset
    if int(limit) < 1 or int(limit) > len(dataset):
        raise Eagle3Error(
            f"train.limit={limit}: the data's train split holds {len(dataset)} rows (use 1..{len(dataset)})"
        )
    subset = Subset(dataset, range(int(limit)))
    subset.lengths = item_lengths(dataset)[: int(limit)]
    return subset


def split_datasets(
    hidden_states: str, states_dtype: str, data_dir: Path, shards: StageOutput | None, capture=None
) -> tuple[Dataset, Dataset]:
    if hidden_states == "online":
        splits = load_splits(data_dir)
        return TokenDataset(splits["train"]), TokenDataset(splits["val"])
    if hidden_states == "engine":
        from eagle3.train.engine_states import EngineStates

        splits = load_splits(data_dir)
        return tuple(
            EngineStates(splits[name], name, capture, states_dtype) for name in ("train", "val")
        )
    if hidden_states != "offline":
        raise Eagle3Error(f"train.hidden_states={hidden_states}: use offline, online or engine")
    splits = load_splits(data_dir)
    return tuple(
        with_lengths(ShardDataset(shards.path, split=name), splits[name])
        for name in ("train", "val")
    )


def with_lengths(shard_set, split):
    """Sequence lengths for bucketing without reading hidden states: shard j of the index holds the
    data split's rows first_row .. first_row + samples - 1, in order."""
    if getattr(shard_set, "lengths", None) is None:
        row_lengths = [len(ids) for ids in split["input_ids"]]
        shard_set.lengths = [
            row_lengths[shard["first_row"] + j]
            for shard in shard_set.shards
            for j in range(shard["samples"])
        ]
        if shard_set.lengths and len(shard_set[0]["input_ids"]) != shard_set.lengths[0]:
            raise Eagle3Error(
                f"the shards at {shard_set.root} do not line up with the data split's rows: "
                "rerun `python -m eagle3.extract`"
            )
    return shard_set


def needs_whole_target(tcfg: TrainConfig) -> bool:
    """Online states and measured acceptance run the target; offline training reads only its
    embedding and head (eagle3.core.target_parts)."""
    return tcfg.hidden_states == "online" or bool(tcfg.eval_prompts)
