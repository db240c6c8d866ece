"""The continuous-batching engine on CUDA graphs against the same engine eager and against the batch-1
decoder: whether their greedy tokens are equal, and the wall time of each batched pass.

    python benchmarks/batch_graphs.py                        # float32, the shipped drafter, on CUDA
    python benchmarks/batch_graphs.py --dtype bfloat16 --spec off d8

Eight chat prompts, four rows in flight (requests join as others finish); each batched engine runs
the prompts twice and the second pass is timed (it replays the graphs the first captured). Per spec
it prints how many prompts' tokens agree (graphs == eager, graphs == batch-1), both wall times and
the graphs captured.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from eagle3.core.common import compose
from eagle3.core.outputs import resolve_drafter_path
from eagle3.core.spec import resolve_spec
from eagle3.core.target import load_target
from eagle3.engine import SpecDecoder
from eagle3.engine.batch_decoder import BatchDecoder
from eagle3.engine.options import DecoderOptions
from eagle3.engine.service import DrafterSource, load_engine_drafter
from eagle3.export.shipped import shipped_drafter

TEXTS = [
    "Explain how a bicycle works.",
    "Write a short poem about the ocean.",
    "What are the main causes of inflation?",
    "Give three tips for learning to code.",
    "Summarise the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
    "Write a Python function that reverses a linked list.",
    "If a train travels 60 miles in 1.5 hours, what is its speed?",
]


def chat_prompts(tokenizer) -> list[list[int]]:
    prompts = []
    for text in TEXTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def timed_pass(decoder: BatchDecoder, prompts: list[list[int]], new_tokens: int):
    """(tokens per prompt, seconds) of one pass of every prompt through the batched engine."""
    requests = [decoder.add(prompt, new_tokens) for prompt in prompts]
    torch.cuda.synchronize()
    start = time.perf_counter()
    decoder.generate_all(requests)
    torch.cuda.synchronize()
    return [r.result.tokens for r in requests], time.perf_counter() - start


def check_spec(cfg, target, name: str, prompts, args) -> str:
    spec = resolve_spec(compose([*args.overrides, f"spec={name}"]).spec)
    source = DrafterSource(
        functools.partial(resolve_drafter_path, cfg, engine="local"), None, cfg.seed
    )
    drafter, _ = load_engine_drafter(source, target, spec)
    tokens, seconds, captured = {}, {}, 0
    for graphs in (False, True):
        decoder = BatchDecoder(
            target,
            drafter,
            spec,
            args.rows,
            DecoderOptions(
                max_context=args.max_context,
                cuda_graphs=graphs,
                graph_batch_sizes=tuple(2**n for n in range(args.rows.bit_length())),
            ),
        )
        for _ in range(2):  # the second pass runs on the graphs the first captured
            tokens[graphs], seconds[graphs] = timed_pass(decoder, prompts, args.new_tokens)
        captured = sum(len(steps.graphs) for steps in decoder.greedy.values())
    single = SpecDecoder(
        target, drafter, spec, DecoderOptions(max_context=args.max_context, cuda_graphs=True)
    )
    alone = [single.generate(prompt, args.new_tokens).tokens for prompt in prompts]
    eager_same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    alone_same = sum(a == b for a, b in zip(tokens[True], alone))
    return (
        f"{name} {args.dtype}: graphs==eager {eager_same}/{len(prompts)}, graphs==batch-1 "
        f"{alone_same}/{len(prompts)}, wall eager {seconds[False]:.2f} s graphs "
        f"{seconds[True]:.2f} s, graph shapes {captured}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32", help="target.dtype")
    parser.add_argument("--spec", nargs="+", default=["off", "d8", "d32s4k8"], help="spec presets")
    parser.add_argument("--rows", type=int, default=4, help="requests in flight")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--root", default="/tmp/e3", help="paths.root")
    args = parser.parse_args()
    args.overrides = [
        f"target.dtype={args.dtype}",
        "target.device=cuda",
        f"paths.root={args.root}",
        "tracking.enabled=false",
    ]
    base = compose([*args.overrides, "drafter.path=shipped"])
    drafter = shipped_drafter(
        base.shipped, base.target, base.paths.artifacts, base.tracking, base.export
    )
    args.overrides.append(f"drafter.path={drafter}")
    cfg = compose(args.overrides)
    target = load_target(cfg.target, cfg.paths.artifacts)
    prompts = chat_prompts(target.tokenizer)
    for name in args.spec:
        print(check_spec(cfg, target, name, prompts, args), flush=True)


if __name__ == "__main__":
    main()
