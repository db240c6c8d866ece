"""Batch-1 decoding speed on the three bench suites, every method on the same prompts:
HF `generate` (greedy), HF prompt-lookup decoding, and the embedded engine with spec=off and
several spec shapes with a trained drafter. Plain argparse (runs on a bare GPU box):

    python benchmarks/e2e_bench.py --target TARGET_DIR --drafter EXPORT_DIR/sglang \
        --suites suite_vicuna.jsonl,suite_humaneval.jsonl,suite_gsm8k.jsonl --prompts 12 \
        --specs off,d16,d10s5k4,d4,d6,d8,d6s3k2 --json results.json

tok/s = completion tokens / wall time over the suite (EOS stops every method alike); τ is
completion tokens / verify steps; `match` (match_hf) is the share of prompts whose output equals the
first method's on that suite (`match_reference`): HF greedy by default, the engine's spec=off with
--baselines "" (a run of spec shapes only compares with its first). At the end it prints every
method's totals over all suites (`python -m eagle3.results totals` sums the files of one run).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from bench_engine import (
    add_engine_options,
    engine_options,
    load,
    load_drafter,
    parse_spec,
    sync,
    timed_generate,
)

from eagle3.engine import SpecDecoder, summarize
from eagle3.totals import report, totals


def read_suite(path: Path, tokenizer, limit: int) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:limit]
    return [
        tokenizer.apply_chat_template(
            r["messages"], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for r in rows
    ]


def hf_generate(model, prompts, max_new_tokens, eos, **extra) -> tuple[list[list[int]], float]:
    outputs, started = [], time.perf_counter()
    for ids in prompts:
        x = torch.tensor([ids], device=model.device)
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
            **extra,
        )
        outputs.append(out[0, len(ids) :].tolist())
    sync()
    return outputs, time.perf_counter() - started


def engine_run(decoder, prompts, max_new_tokens, eos) -> tuple[list[list[int]], float, dict]:
    results, wall = timed_generate(decoder, prompts, max_new_tokens, [eos])
    return [r.tokens for r in results], wall, summarize([r.stats for r in results])


def strip_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True, help="exported drafter folder")
    parser.add_argument(
        "--suites", required=True, help="comma-separated JSONL files with `messages`"
    )
    parser.add_argument("--prompts", type=int, default=12, help="first N prompts of each suite")
    parser.add_argument("--specs", default="off,d16,d10s5k4")
    parser.add_argument(
        "--baselines", default="hf,pld", help="hf (generate), pld (prompt lookup); empty = none"
    )
    parser.add_argument("--pld-tokens", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-context", type=int, default=2048)
    add_engine_options(parser)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    args.random_from, args.cuda_graphs = None, args.device == "cuda"
    target = load(args)
    drafter = load_drafter(args, target)
    eos = target.tokenizer.eos_token_id
    rows, reference, reference_method = [], {}, {}
    for suite_path in map(Path, args.suites.split(",")):
        suite = suite_path.stem.removeprefix("suite_")
        prompts = read_suite(suite_path, target.tokenizer, args.prompts)
        methods = [m for m in args.baselines.split(",") if m] + args.specs.split(",")
        for method in methods:
            if method in ("hf", "pld"):
                extra = {"prompt_lookup_num_tokens": args.pld_tokens} if method == "pld" else {}
                outputs, wall = hf_generate(
                    target.model, prompts, args.max_new_tokens, eos, **extra
                )
                row = {}
            else:
                spec = parse_spec(method)
                decoder = SpecDecoder(
                    target,
                    drafter if spec.enabled else None,
                    spec,
                    max_context=args.max_context,
                    cuda_graphs=args.cuda_graphs,
                    **engine_options(args),
                )
                outputs, wall, summary = engine_run(decoder, prompts, args.max_new_tokens, eos)
                steps = max(summary["verify_steps"], 1)
                host_s = (
                    wall
                    - summary["prefill_time_s"]
                    - summary["draft_time_s"]
                    - summary["verify_time_s"]
                )
                row = {
                    "tau": summary["tau"],
                    "verify_steps": summary["verify_steps"],
                    "fused": decoder.fused is not None,
                    "prefill_ms_per_prompt": 1000 * summary["prefill_time_s"] / len(prompts),
                    "draft_ms_per_step": 1000 * summary["draft_time_s"] / steps,
                    "verify_ms_per_step": 1000 * summary["verify_time_s"] / steps,
                    "host_ms_per_step": 1000 * host_s / steps,
                    "acceptance_per_position": summary["acceptance_per_position"],
                }
                method = spec.label
            outputs = [strip_eos(o, eos) for o in outputs]
            reference.setdefault(suite, outputs)
            reference_method.setdefault(suite, method)
            tokens = sum(len(o) for o in outputs)
            match = sum(a == b for a, b in zip(outputs, reference[suite])) / len(outputs)
            rows.append(
                {
                    "suite": suite,
                    "method": method,
                    "prompts": len(prompts),
                    "tokens": tokens,
                    "wall_s": wall,
                    "tok_per_s": tokens / wall,
                    "match_hf": match,
                    "match_reference": reference_method[suite],
                    **row,
                }
            )
            phases = (
                f"  prefill {row['prefill_ms_per_prompt']:.1f} ms/prompt, per step draft "
                f"{row['draft_ms_per_step']:.2f} verify {row['verify_ms_per_step']:.2f} host "
                f"{row['host_ms_per_step']:.2f} ms"
                if row
                else ""
            )
            print(
                f"{suite:>10} {method:>10}: {tokens / wall:8.1f} tok/s  tau {row.get('tau', float('nan')):.2f}  "
                f"match {match:.2f}{phases}",
                flush=True,
            )
            Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(report(totals(rows)), flush=True)


if __name__ == "__main__":
    main()
