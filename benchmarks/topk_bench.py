"""Microseconds per draft-step top-k over a drafter vocab, replayed from a CUDA graph.

Compares torch's topk of the log-softmax (the engine before commit 6fee78b) with
tree.top_children (the k chunks with the largest maxima, two short sorts), eager and torch.compile'd:

    python benchmarks/topk_bench.py --vocab 32768 --rows 1,8,16 --k 2,8,16 --json topk.json
"""

from __future__ import annotations

import argparse
import json

import torch

from eagle3.engine.tree import top_children


def torch_topk(logits: torch.Tensor, k: int):
    top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return top.values, top.indices


def replay_us(fn, logits: torch.Tensor, k: int, replays: int) -> float:
    """Mean µs of one call of fn(logits, k) captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the capture
            fn(logits, k)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(logits, k)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / replays


def show(row: dict) -> None:
    print(
        "  ".join(
            f"{key} {value:.1f}" if isinstance(value, float) else f"{key} {value}"
            for key, value in row.items()
        ),
        flush=True,
    )


def write_rows(rows: list[dict], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--k", default="2,8,16")
    parser.add_argument("--replays", type=int, default=1000)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch._dynamo.config.recompile_limit = 64
    ways = {
        "torch.topk": torch_topk,
        "top_children": top_children,
        "top_children compiled": torch.compile(top_children, dynamic=False),
    }
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        for k in (int(v) for v in args.k.split(",")):
            logits = torch.randn(rows, args.vocab, device="cuda", dtype=torch.bfloat16)
            reference = torch_topk(logits, k)
            row = {"rows": rows, "k": k}
            for name, fn in ways.items():
                values, indices = fn(logits, k)
                assert torch.allclose(values, reference[0], atol=1e-5), (
                    name
                )  # ties may pick other ids
                row[name] = replay_us(fn, logits, k, args.replays)
            show(row)
            rows_out.append(row)
    write_rows(rows_out, args.json)


if __name__ == "__main__":
    main()
