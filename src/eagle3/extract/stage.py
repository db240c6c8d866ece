"""The extract stage: the target's hidden states for the data stage's conversations,
in packed safetensors shards (offline mode of training).

Per split, shards hold consecutive dataset rows: `aux_hidden [N, 3H]` and `last_hidden [N, H]`
(bf16), `input_ids` and `loss_mask` [N], `offsets [S+1]` (sample s is rows offsets[s]:offsets[s+1]),
`rows [S]` (dataset row indices); the conversation ids are in the file's metadata. Each shard
is written to a temporary name, verified, then renamed: a rerun skips shards already in place.
`index.json` lists the shards; the manifest marks the whole output complete. `python -m
eagle3.extract` (app.py) runs it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from eagle3.core.artifacts import StageOutput
from eagle3.core.common import Eagle3Error, log
from eagle3.core.config import Config, ExtractConfig
from eagle3.core.outputs import extract_output
from eagle3.core.target import load_target, resolve_target_path, tokenizer_hash
from eagle3.core.tracking import stage_run
from eagle3.data import stage as data
from eagle3.data.splits import load_splits
from eagle3.data.tokens import load_tokenizer
from eagle3.extract.shards import STORAGE_DTYPES, ShardPlan
from eagle3.extract.vllm_capture import VllmCapture, capture_launch, target_shape

FORMAT = "eagle3-hidden-shard-v1"
BACKENDS = ("hf", "vllm")


# ---------------------------------------------------------------- capture (shared with online training)


def hidden_states(target, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [B, T, 3H], last [B, T, H]) for right-padded token ids: the one capture path used by
    offline extraction and by online training.

    No attention mask is needed: with right padding and causal attention a real token never
    sees the padding after it, and the states at padding positions are discarded by the caller."""
    return target.capture(input_ids.to(target.device))


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by length so that (rows x longest) stays within batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


def right_padded(sequences: list[list[int]], pad_id: int) -> torch.Tensor:
    ids = torch.full((len(sequences), max(map(len, sequences))), pad_id, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(seq)
    return ids


# ---------------------------------------------------------------- shards


def plan_shards(split: str, rows, shard_tokens: int) -> list[ShardPlan]:
    """Consecutive dataset rows, cut when a shard would pass shard_tokens (a longer row gets its own)."""
    plans, start, tokens = [], 0, 0
    lengths = [len(ids) for ids in rows["input_ids"]]
    for i, length in enumerate(lengths + [None]):
        if i == len(lengths) or (i > start and tokens + length > shard_tokens):
            if i > start:
                plans.append(
                    ShardPlan(
                        split,
                        len(plans),
                        start,
                        rows["input_ids"][start:i],
                        rows["loss_mask"][start:i],
                        rows["id"][start:i],
                    )
                )
            start, tokens = i, 0
        if length is not None:
            tokens += length
    return plans


def split_plans(ecfg: ExtractConfig, splits) -> list[ShardPlan]:
    """The shards of every split extract.splits names, in order."""
    return [
        plan
        for name in ecfg.splits
        for plan in plan_shards(name, splits[name][:], ecfg.shard_tokens)
    ]


def extract_shard(
    target, plan: ShardPlan, batch_tokens: int, dtype: torch.dtype, progress: tqdm | None = None
) -> dict[str, torch.Tensor]:
    """The shard's tensors. States are gathered on the target's device and copied to the host once
    per shard, so the accelerator never waits on a per-batch copy."""
    lengths = [len(ids) for ids in plan.input_ids]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    hidden, device = target.hidden_size, target.device
    aux_all = torch.empty(int(offsets[-1]), 3 * hidden, dtype=dtype, device=device)
    last_all = torch.empty(int(offsets[-1]), hidden, dtype=dtype, device=device)
    pad_id = target.tokenizer.pad_token_id or 0
    for batch in length_batches(lengths, batch_tokens):
        ids = right_padded([plan.input_ids[i] for i in batch], pad_id)
        aux, last = hidden_states(target, ids)
        # flat positions of the real tokens (padding is never stored); index tensors built on the
        # host keep the device free of synchronising boolean masks
        source = torch.cat(
            [torch.arange(lengths[i]) + row * ids.shape[1] for row, i in enumerate(batch)]
        )
        dest = torch.cat([torch.arange(int(offsets[i]), int(offsets[i + 1])) for i in batch])
        source, dest = source.to(device, non_blocking=True), dest.to(device, non_blocking=True)
        aux_all.index_copy_(0, dest, aux.flatten(0, 1).index_select(0, source).to(dtype))
        last_all.index_copy_(0, dest, last.flatten(0, 1).index_select(0, source).to(dtype))
        if progress is not None:
            progress.update(sum(lengths[i] for i in batch))
    return {
        "aux_hidden": to_host(aux_all),
        "last_hidden": to_host(last_all),
        "input_ids": torch.tensor([t for ids in plan.input_ids for t in ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for mask in plan.loss_masks for m in mask], dtype=torch.int8),
        "offsets": offsets.to(torch.int64),
        "rows": torch.arange(plan.first_row, plan.first_row + len(lengths), dtype=torch.int64),
    }


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy into pinned host memory on CUDA (the writer waits for it, the GPU does not)."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def copies_done(device: torch.device):
    """An event the writer waits on before reading the host copies (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def extract_shards(
    target,
    plans: list[ShardPlan],
    root: Path,
    batch_tokens: int,
    dtype: torch.dtype,
    verify: bool,
    progress: tqdm | None = None,
    writers: int = 1,
    compute=None,
) -> int:
    """Compute and write `plans`: shards compute while up to `writers` earlier ones are saved
    (disk is the bottleneck on a fast GPU). `compute(plan)` gives a shard's tensors (default: the
    HF capture of `target`; the vllm backend passes its server's). Returns bytes written."""
    if compute is None:

        def compute(plan):
            return extract_shard(target, plan, batch_tokens, dtype, progress)

    written = 0
    with ThreadPoolExecutor(max_workers=writers) as pool:
        pending: list[Future] = []
        for plan in plans:
            tensors = compute(plan)
            if len(pending) >= writers:  # bound host memory: at most `writers` shards in flight
                written += pending.pop(0).result()
            pending.append(
                pool.submit(
                    write_shard,
                    tensors,
                    plan,
                    root,
                    target.hidden_size,
                    verify,
                    copies_done(target.device),
                )
            )
        written += sum(f.result() for f in pending)
    return written


class ShardInvalid(Exception):
    pass


def check_shard(path: Path, plan: ShardPlan, hidden: int, full: bool) -> None:
    """Raise ShardInvalid unless the shard holds `plan`'s rows: offsets, shapes, token ids, ids, and
    (full) finite states. The non-full check reads only the header and the small tensors."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            small = {k: f.get_tensor(k) for k in ("input_ids", "loss_mask", "offsets")}
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in ("aux_hidden", "last_hidden")}
    except Exception as err:  # a truncated or foreign file: redo it
        raise ShardInvalid(f"unreadable ({type(err).__name__})") from err
    n = plan.tokens
    lengths = [len(ids) for ids in plan.input_ids]
    if meta.get("format") != FORMAT or json.loads(meta.get("ids", "[]")) != plan.ids:
        raise ShardInvalid("metadata or conversation ids differ")
    if shapes != {"aux_hidden": (n, 3 * hidden), "last_hidden": (n, hidden)}:
        raise ShardInvalid(f"shapes {shapes} for {n} tokens")
    if small["offsets"].tolist() != torch.tensor([0] + lengths).cumsum(0).tolist():
        raise ShardInvalid("offsets differ")
    if small["input_ids"].tolist() != [t for ids in plan.input_ids for t in ids]:
        raise ShardInvalid("token ids differ from the dataset")
    if small["loss_mask"].tolist() != [m for mask in plan.loss_masks for m in mask]:
        raise ShardInvalid("loss mask differs from the dataset")
    if full:
        tensors = load_file(str(path))
        if not (
            torch.isfinite(tensors["aux_hidden"]).all()
            and torch.isfinite(tensors["last_hidden"]).all()
        ):
            raise ShardInvalid("non-finite hidden states")


def write_shard(
    tensors: dict[str, torch.Tensor],
    plan: ShardPlan,
    root: Path,
    hidden: int,
    verify: bool,
    copied=None,
) -> int:
    """Save under a temporary name, verify, rename into place; returns the file's bytes."""
    if copied is not None:
        copied.synchronize()
    final = root / plan.file
    tmp = final.with_suffix(".tmp")
    save_file(
        tensors,
        str(tmp),
        metadata={"format": FORMAT, "split": plan.split, "ids": json.dumps(plan.ids)},
    )
    try:
        check_shard(tmp, plan, hidden, full=verify)
    except ShardInvalid as err:
        tmp.unlink(missing_ok=True)
        raise Eagle3Error(f"shard {final} failed verification right after writing: {err}") from err
    tmp.replace(final)
    return final.stat().st_size


# ---------------------------------------------------------------- the stage


def disk_estimate(tokens: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes of a full extraction: 4 states of H per token (3 aux + last) plus ids and mask."""
    return tokens * (4 * hidden * dtype.itemsize + 4 + 1)


def check_disk(
    root: Path, todo_tokens: int, total_tokens: int, hidden: int, dtype: torch.dtype, margin: float
):
    need = disk_estimate(todo_tokens, hidden, dtype)
    free = shutil.disk_usage(root).free
    per_token = 4 * hidden * dtype.itemsize
    print(
        f"extract: {total_tokens:,} tokens x 4 x {hidden} x {dtype.itemsize} B = {per_token / 1e3:.1f} kB/token "
        f"-> {disk_estimate(total_tokens, hidden, dtype) / 1e9:.2f} GB in all, {need / 1e9:.2f} GB still to write, "
        f"{free / 1e9:.1f} GB free. For much larger data, train.hidden_states=online computes the states "
        "inside the training step and writes nothing."
    )
    if need * margin > free:
        raise Eagle3Error(
            f"extraction needs {need / 1e9:.1f} GB but {root} has {free / 1e9:.1f} GB free; free space, "
            "or use train.hidden_states=online (no shards)"
        )


def run(cfg: Config) -> StageOutput:
    """Extract every configured split (a no-op when complete; resumes at shard granularity)."""
    ecfg = cfg.extract
    check_backend(ecfg)
    data_out = data.run(cfg)
    out = extract_output(cfg)
    with out.lock():  # runs started at once (a parallel launcher): one builds, the others reuse
        if out.reusable(cfg.verify):
            return out
        with stage_run(cfg, "extract", artifact_hash=out.hash) as mlflow_run:
            out.start()
            plans = split_plans(ecfg, load_splits(data_out.path))
            # the states' source, the HF target here or a vLLM capture server: both give
            # hidden_size, aux_layer_ids, tokenizer and device
            if ecfg.backend == "hf":
                source = contextlib.nullcontext(load_target(cfg.target, cfg.paths.artifacts))
            else:
                shape = target_shape(
                    cfg.target, resolve_target_path(cfg.target, Path(cfg.paths.artifacts))
                )
                command = functools.partial(capture_launch, cfg, shape)
                capture = VllmCapture(command, ecfg, shape, out.path / "engine")
                capture.tokenizer = load_tokenizer(cfg.target, cfg.paths.artifacts)[0]
                source = served_when_needed(capture, out.path, plans)
            with source as target:
                check_tokenizer(target.tokenizer, data_out)
                stats = extract_all(ecfg, target, plans, out.path)
            write_index(out.path, ecfg, target, plans)
            if mlflow_run is not None:
                import mlflow

                mlflow.log_metrics({k: float(v) for k, v in stats.items()})
            out.finish(stats)
        return out


def check_backend(ecfg: ExtractConfig) -> None:
    if ecfg.backend not in BACKENDS:
        raise Eagle3Error(
            f"extract.backend={ecfg.backend}: use one of {', '.join(BACKENDS)} "
            "(hf = the target in this process, vllm = a vLLM server the stage starts)"
        )


@contextlib.contextmanager
def served_when_needed(
    capture: VllmCapture, root: Path, plans: list[ShardPlan]
) -> Iterator[VllmCapture]:
    """`capture` with its server started, stopped on exit; not started when every shard of `plans`
    is already in place under `root`."""
    if all(shard_in_place(root, p, capture.hidden_size) for p in plans):
        yield capture
        return
    with capture:
        yield capture


def check_tokenizer(tokenizer, data_out: StageOutput) -> None:
    expected = data_out.manifest().get("counts", {}).get("tokenizer_hash")
    if expected and expected != tokenizer_hash(tokenizer):
        raise Eagle3Error(
            f"the target's tokenizer differs from the one that tokenized {data_out.path}"
        )


def extract_all(
    ecfg: ExtractConfig, target, plans: list[ShardPlan], root: Path
) -> dict[str, float]:
    dtype = STORAGE_DTYPES.get(ecfg.dtype)
    if dtype is None:
        raise Eagle3Error(f"extract.dtype={ecfg.dtype}: use one of {', '.join(STORAGE_DTYPES)}")
    for split in {p.split for p in plans}:
        (root / split).mkdir(parents=True, exist_ok=True)
        for stale in (root / split).glob("*.tmp"):  # a write a kill interrupted
            stale.unlink()
    todo = [p for p in plans if not shard_in_place(root, p, target.hidden_size)]
    check_disk(
        root,
        sum(p.tokens for p in todo),
        sum(p.tokens for p in plans),
        target.hidden_size,
        dtype,
        ecfg.disk_margin,
    )
    started = time.time()
    progress = tqdm(total=sum(p.tokens for p in todo), desc="extract", unit=" tok", unit_scale=True)
    compute = None
    if ecfg.backend == "vllm":

        def compute(plan):
            return target.shard(plan, dtype, progress)

    written = extract_shards(
        target, todo, root, ecfg.batch_tokens, dtype, ecfg.verify, progress, ecfg.writers, compute
    )
    progress.close()
    seconds = time.time() - started
    tokens = sum(p.tokens for p in todo)
    return {
        "shards": len(plans),
        "shards_resumed": len(plans) - len(todo),
        "tokens": sum(p.tokens for p in plans),
        "tokens_extracted": tokens,
        "bytes_written": written,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if tokens else 0.0,
    }


def shard_in_place(root: Path, plan: ShardPlan, hidden: int) -> bool:
    """A shard under its final name was verified before its rename; a cheap check guards against a
    different dataset or a damaged file."""
    path = root / plan.file
    if not path.exists():
        return False
    try:
        check_shard(path, plan, hidden, full=False)
        return True
    except ShardInvalid as err:
        log.warning("redoing %s: %s", path, err)
        path.unlink()
        return False


def write_index(root: Path, ecfg: ExtractConfig, target, plans: list[ShardPlan]) -> None:
    splits: dict[str, list[dict]] = {name: [] for name in ecfg.splits}
    for p in plans:
        splits[p.split].append(
            {
                "file": p.file,
                "first_row": p.first_row,
                "samples": len(p.ids),
                "tokens": p.tokens,
                "bytes": (root / p.file).stat().st_size,
            }
        )
    index = {
        "format": FORMAT,
        "hidden_size": target.hidden_size,
        "aux_layer_ids": list(target.aux_layer_ids),
        "dtype": ecfg.dtype,
        "splits": splits,
    }
    tmp = root / "index.json.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    tmp.replace(root / "index.json")
