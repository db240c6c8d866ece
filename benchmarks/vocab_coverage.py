"""How much of the target's own greedy answers on the bench suites a draft vocabulary can express.

A token outside the drafter's vocabulary is never drafted, so every verify step that meets one
accepts nothing past it: the share of such tokens caps acceptance at every depth. Decodes the first
--prompts prompts of each suite greedily with the engine (spec=off) and reports, per suite, the share
of answer tokens outside --drafter's vocab map and outside the vocab map that the data stage's own
build_vocab_map makes from --data's train split with drafter.draft_vocab_size=V, for each V of --sizes:

    python benchmarks/vocab_coverage.py --target artifacts/targets/smollm2-135m \\
        --drafter artifacts/export/<hash>/sglang --data artifacts/data/<hash> \\
        --suites suite_vicuna.jsonl,suite_humaneval.jsonl,suite_gsm8k.jsonl --json coverage.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from bench_engine import load, load_drafter, read_suite, strip_eos

from eagle3.core.spec import OFF
from eagle3.data.splits import load_splits
from eagle3.data.vocab import build_vocab_map
from eagle3.engine import DecodeRequest, SpecDecoder


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True, help="HF model folder (with tokenizer)")
    parser.add_argument("--drafter", help="exported drafter folder: its own vocab map")
    parser.add_argument(
        "--data", help="data stage folder: vocab maps of --sizes built from its train split"
    )
    parser.add_argument("--sizes", default="8192,16384,32768")
    parser.add_argument("--suites", required=True, help="comma-separated suite JSONL files")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json")
    args = parser.parse_args()
    target = load(
        SimpleNamespace(device=args.device, dtype=args.dtype, random_from=None, target=args.target)
    )
    vocabs: dict[str, set[int]] = {}
    if args.drafter:
        drafter = load_drafter(SimpleNamespace(drafter=args.drafter), target)
        vocabs["drafter"] = set(drafter.t2d.nonzero().flatten().tolist())
    if args.data:
        train = load_splits(args.data)["train"]
        for size in map(int, args.sizes.split(",")):
            _, t2d, _ = build_vocab_map(
                train["input_ids"], train["loss_mask"], target.vocab_size, size
            )
            vocabs[f"vocab {size}"] = set(t2d.nonzero().flatten().tolist())
    eos = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    decoder = SpecDecoder(target, None, OFF)
    rows = []
    for suite in args.suites.split(","):
        answers = []
        for prompt in read_suite(Path(suite), target.tokenizer, args.prompts):
            answers += strip_eos(
                decoder.generate(DecodeRequest(prompt, args.max_new_tokens, stop_ids=[eos])).tokens,
                eos,
            )
        outside = {
            name: sum(t not in vocab for t in answers) / len(answers)
            for name, vocab in vocabs.items()
        }
        rows.append({"suite": Path(suite).stem, "tokens": len(answers), "outside": outside})
        print(
            f"{Path(suite).stem:>20} {len(answers):5d} tokens, outside: "
            + "  ".join(f"{name} {share:.3f}" for name, share in outside.items()),
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
