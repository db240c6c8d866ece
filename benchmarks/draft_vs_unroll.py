"""Is a trained drafter used at inference, at every depth, as training showed it? On a real target.

Decodes the first --prompts prompts of each suite with a chain spec (greedy, fused engine path)
and records every chain it drafts. Then runs the TTT unroll (eagle3.train.ttt) over each committed
sequence and compares: draft k of a chain from root position p must equal the unroll's step-k
argmax at position p - 1, wherever drafts 0..k-1 were the committed tokens (the unroll feeds true
tokens). Prints per depth the drafts compared, how many are equal, the engine's acceptance there
(given the earlier drafts were accepted) and the unroll's unconditional accuracy on the same
sequences. tests/unit/engine/test_engine.py checks the equality on the tiny target; this runs it on yours:

    PYTHONPATH=benchmarks python benchmarks/draft_vs_unroll.py --target artifacts/targets/smollm2-135m \\
        --drafter artifacts/export/<hash>/sglang --suites suite_vicuna.jsonl --prompts 4 --spec d8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from bench_engine import load, load_drafter, parse_spec, read_suite

from eagle3.engine import DecodeRequest, SpecDecoder
from eagle3.engine.fused import FusedGreedy
from eagle3.train.ttt import unroll


def record_chains(chains: list) -> None:
    draft_chain = FusedGreedy.draft_chain

    def recording(self):
        draft_chain(self)
        chains.append((int(self.position), self.tokens.tolist()))

    FusedGreedy.draft_chain = recording


def compare(
    target, drafter, prompt: list[int], answer: list[int], chains: list, counts: dict
) -> None:
    sequence = prompt + answer
    ids = torch.tensor([sequence], device=target.device)
    aux, _ = target.capture(ids)
    with torch.no_grad():
        steps = [
            drafter.to_target_ids(logits[0].argmax(-1)).tolist()
            for logits in unroll(drafter, ids, aux, len(counts["compared"]))
        ]
    for position, chain in chains:
        for k, drafted in enumerate(chain[1:]):
            if position + k + 1 >= len(sequence):
                break
            counts["compared"][k] += 1
            counts["equal"][k] += drafted == steps[k][position - 1]
            accepted = drafted == sequence[position + k + 1]
            counts["accepted"][k] += accepted
            if not accepted:
                break
    for t in range(len(prompt) - 1, len(sequence) - 1):
        for k in range(len(steps)):
            if t + k + 2 < len(sequence):
                counts["unroll_total"][k] += 1
                counts["unroll_right"][k] += steps[k][t] == sequence[t + k + 2]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True, help="HF model folder (with tokenizer)")
    parser.add_argument("--drafter", required=True, help="exported drafter folder")
    parser.add_argument("--suites", required=True, help="comma-separated suite JSONL files")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--spec", default="d8", help="a chain: dN")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json")
    args = parser.parse_args()
    spec = parse_spec(args.spec)
    if spec.topk != 1:
        raise SystemExit(f"--spec {args.spec}: a chain (dN) is needed")
    target = load(
        SimpleNamespace(device=args.device, dtype=args.dtype, random_from=None, target=args.target)
    )
    drafter = load_drafter(SimpleNamespace(drafter=args.drafter), target)
    chains: list = []
    record_chains(chains)
    decoder = SpecDecoder(target, drafter, spec, fused=True)
    eos = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for suite in args.suites.split(","):
        counts = {
            name: [0] * spec.steps
            for name in ("compared", "equal", "accepted", "unroll_total", "unroll_right")
        }
        for prompt in read_suite(Path(suite), target.tokenizer, args.prompts):
            chains.clear()
            answer = decoder.generate(
                DecodeRequest(prompt, args.max_new_tokens, stop_ids=[eos])
            ).tokens
            compare(target, drafter, prompt, answer, chains, counts)
        rows.append({"suite": Path(suite).stem, **counts})
        print(Path(suite).stem)
        for k in range(spec.steps):
            print(
                f"  draft {k}: equal {counts['equal'][k]}/{counts['compared'][k]}, engine acceptance "
                f"{counts['accepted'][k] / max(counts['compared'][k], 1):.3f}, unroll accuracy "
                f"{counts['unroll_right'][k] / max(counts['unroll_total'][k], 1):.3f}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
