"""Extraction throughput against a bare target forward over the same batches, and data-stage rows/s.

    python benchmarks/bench_extract.py extract --target smollm2-135m --batch 16x1024 --shards 4
    python benchmarks/bench_extract.py extract --target smollm2-shape   # random weights, SmolLM2's shape:
                                                                        # same speed, no weights to ship
    python benchmarks/bench_extract.py data --limit 2000                # ShareGPT -> tokenized dataset, CPU
    python benchmarks/bench_extract.py backends --batch 8x256 --shards 4  # extract.backend hf vs vllm

`extract` times (a) `model.model(ids)` over every batch (the bare forward, no lm_head) and (b) the
real extraction path (`eagle3.extract.stage.extract_shards`: capture, gather, host copy, safetensors write,
verification, rename) over the same batches, and prints one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eagle3.core.common import compose  # noqa: E402
from eagle3.core.target import Target, load_target, resolve_target_path  # noqa: E402
from eagle3.extract import stage as extract  # noqa: E402
from eagle3.extract.shards import ShardPlan  # noqa: E402
from eagle3.extract.vllm_capture import VllmCapture, capture_launch, target_shape  # noqa: E402

SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


def load_bench_target(name: str, device: str, dtype: str) -> Target:
    if name == "smollm2-shape":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).to(
            device=device, dtype=getattr(torch, dtype)
        )
        layers = SMOLLM2_SHAPE["num_hidden_layers"]
        return Target(
            model.eval().requires_grad_(False),
            SimpleNamespace(pad_token_id=2),
            Path("random"),
            [2, layers // 2, layers - 3],
        )

    cfg = compose([f"target={name}", f"target.dtype={dtype}", f"target.device={device}"])
    return load_target(cfg.target, cfg.paths.artifacts)


def synthetic_plans(rows: int, length: int, shards: int, vocab: int) -> list[ShardPlan]:
    """`shards` shards of `rows` sequences of `length` random tokens: one batch per shard at batch
    tokens = rows * length."""
    generator = torch.Generator().manual_seed(0)
    plans = []
    for number in range(shards):
        ids = torch.randint(3, vocab, (rows, length), generator=generator).tolist()
        plans.append(
            ShardPlan(
                "train",
                number,
                number * rows,
                ids,
                [[1] * length] * rows,
                [f"s{number}-{r}" for r in range(rows)],
            )
        )
    return plans


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_bare(target: Target, plans, batch_tokens: int) -> float:
    started = time.perf_counter()
    for plan in plans:
        lengths = [len(ids) for ids in plan.input_ids]
        for batch in extract.length_batches(lengths, batch_tokens):
            ids = extract.right_padded([plan.input_ids[i] for i in batch], 0).to(target.device)
            target.model.model(input_ids=ids, use_cache=False)
    synchronize(target.device)
    return time.perf_counter() - started


def time_extract(
    target: Target, plans, batch_tokens: int, verify: bool, writers: int
) -> tuple[float, int]:
    with tempfile.TemporaryDirectory(dir=".") as root:
        (Path(root) / "train").mkdir()
        started = time.perf_counter()
        written = extract.extract_shards(
            target, plans, Path(root), batch_tokens, torch.bfloat16, verify, writers=writers
        )
        synchronize(target.device)
        return time.perf_counter() - started, written


def time_capture_only(target: Target, plans, batch_tokens: int) -> float:
    """extract_shard alone: capture, gather, one host copy per shard; nothing written."""
    started = time.perf_counter()
    for plan in plans:
        extract.extract_shard(target, plan, batch_tokens, torch.bfloat16)
    synchronize(target.device)
    return time.perf_counter() - started


def bench_extract(args) -> dict:
    device = torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    dtype = (
        args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    )
    target = load_bench_target(args.target, str(device), dtype)
    rows, length = map(int, args.batch.split("x"))
    plans = synthetic_plans(rows, length, args.shards, target.vocab_size)
    batch_tokens = rows * length
    time_bare(target, plans[:1], batch_tokens)  # warm-up (kernels, allocator)
    tokens = args.shards * rows * length
    bare = min(time_bare(target, plans, batch_tokens) for _ in range(args.repeats))
    capture = min(time_capture_only(target, plans, batch_tokens) for _ in range(args.repeats))
    timed = [
        time_extract(target, plans, batch_tokens, args.verify, args.writers)
        for _ in range(args.repeats)
    ]
    seconds, written = min(timed)
    return {
        "bench": "extract",
        "target": args.target,
        "device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "dtype": dtype,
        "batch": args.batch,
        "shards": args.shards,
        "tokens": tokens,
        "verify": args.verify,
        "writers": args.writers,
        "bare_tok_s": round(tokens / bare),
        "capture_only_tok_s": round(tokens / capture),
        "capture_ratio": round(bare / capture, 3),
        "extract_tok_s": round(tokens / seconds),
        "ratio": round(bare / seconds, 3),
        "bytes_per_token": round(written / tokens, 1),
    }


def bench_backends(args) -> dict:
    """The hf and vllm extract backends over the same shards of random tokens (SmolLM2 float32 on
    the CPU by default): each writes real verified shards; vLLM's start-up is timed apart."""
    rows, length = map(int, args.batch.split("x"))
    cfg = compose(
        [
            f"target={args.target}",
            "target.dtype=float32",
            "extract.backend=vllm",
            f"data.max_length={length}",
            f"extract.concurrency={args.concurrency}",
            f"extract.engine.max_num_seqs={args.concurrency}",
            f"extract.batch_tokens={rows * length}",
        ]
    )
    target = load_target(cfg.target, cfg.paths.artifacts)
    plans = synthetic_plans(rows, length, args.shards + 1, target.vocab_size)
    warm, plans = plans[:1], plans[1:]
    tokens = args.shards * rows * length
    dtype = torch.bfloat16
    with tempfile.TemporaryDirectory(dir=".") as root:
        (Path(root) / "train").mkdir()
        extract.extract_shard(target, warm[0], rows * length, dtype)
        started = time.perf_counter()
        extract.extract_shards(target, plans, Path(root), rows * length, dtype, True, writers=2)
        hf_s = time.perf_counter() - started
        del target
        shape = target_shape(cfg.target, resolve_target_path(cfg.target, Path(cfg.paths.artifacts)))
        started = time.perf_counter()
        command = functools.partial(capture_launch, cfg, shape)
        with VllmCapture(command, cfg.extract, shape, Path(root) / "engine") as capture:
            startup_s = time.perf_counter() - started
            capture.shard(warm[0], dtype)
            started = time.perf_counter()
            extract.extract_shards(
                capture,
                plans,
                Path(root),
                rows * length,
                dtype,
                True,
                writers=2,
                compute=lambda plan: capture.shard(plan, dtype),
            )
            vllm_s = time.perf_counter() - started
    return {
        "bench": "backends",
        "target": args.target,
        "batch": args.batch,
        "shards": args.shards,
        "tokens": tokens,
        "hf_tok_s": round(tokens / hf_s, 1),
        "vllm_tok_s": round(tokens / vllm_s, 1),
        "vllm_over_hf": round(hf_s / vllm_s, 3),
        "vllm_startup_s": round(startup_s, 1),
        "vllm_concurrency": args.concurrency,
    }


def bench_data(args) -> dict:
    from eagle3.core.common import compose
    from eagle3.data import stage as data

    with tempfile.TemporaryDirectory() as root:
        artifacts = Path(root) / "artifacts"
        artifacts.mkdir()
        overrides = [
            f"target={args.target}",
            f"paths.artifacts={artifacts}",
            "tracking.enabled=false",
        ]
        if args.limit:
            overrides.append(f"data.limit={args.limit}")
        if args.targets_from:
            (artifacts / "targets").symlink_to(Path(args.targets_from).resolve())
        started = time.perf_counter()
        out = data.run(compose(overrides))
        seconds = time.perf_counter() - started
        counts = out.manifest()["counts"]
    return {
        "bench": "data",
        "target": args.target,
        "limit": args.limit,
        "rows_read": counts["rows"],
        "conversations": counts["train_conversations"] + counts["val_conversations"],
        "tokens": counts["train_tokens"] + counts["val_tokens"],
        "seconds": round(seconds, 2),
        "rows_per_s": round(counts["rows"] / seconds, 1),
        "conversations_per_s": round(
            (counts["train_conversations"] + counts["val_conversations"]) / seconds, 1
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="bench", required=True)
    ext = sub.add_parser("extract")
    ext.add_argument(
        "--target", default="tiny-llama", help="tiny-llama | smollm2-135m | smollm2-shape"
    )
    ext.add_argument("--batch", default="16x1024", help="ROWSxLENGTH per forward")
    ext.add_argument("--shards", type=int, default=4, help="shards (one batch each) per timed pass")
    ext.add_argument("--repeats", type=int, default=3, help="timed passes; the fastest counts")
    ext.add_argument("--device", default="auto")
    ext.add_argument(
        "--dtype", default="auto", help="compute dtype: auto = bfloat16 on GPU, float32 on CPU"
    )
    ext.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True)
    ext.add_argument(
        "--writers", type=int, default=2, help="shard-writing threads (extract.writers)"
    )
    back = sub.add_parser("backends")
    back.add_argument("--target", default="smollm2-135m")
    back.add_argument("--batch", default="8x256", help="ROWSxLENGTH per shard")
    back.add_argument("--shards", type=int, default=4, help="timed shards (after one warm-up)")
    back.add_argument("--concurrency", type=int, default=8, help="vLLM requests in flight")
    dat = sub.add_parser("data")
    dat.add_argument("--target", default="tiny-llama")
    dat.add_argument(
        "--limit", type=int, default=None, help="conversations after filtering (default all)"
    )
    dat.add_argument(
        "--targets-from", default=None, help="an artifacts/targets folder with converted targets"
    )
    args = parser.parse_args()
    run = {"extract": bench_extract, "backends": bench_backends, "data": bench_data}[args.bench]
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
