"""Decoding speed under load: the embedded engine's continuous batching (engine/batch.py) at several
concurrencies, spec=off and spec shapes with a trained drafter, next to HF `generate` over batches of
the same size and the fused batch-1 decoder. Plain argparse (runs on a bare GPU box):

    python benchmarks/load_bench.py --target TARGET_DIR --drafter EXPORT_DIR/sglang \
        --suites suite_vicuna.jsonl,suite_humaneval.jsonl,suite_gsm8k.jsonl \
        --specs off,d8,d32s4k8 --batch-sizes 64,16,4,1 --json load.json

At batch size B a suite's first max(--min-prompts, --waves * B) prompts (at most the suite) are
decoded with B requests in flight: a new request joins as soon as one finishes (HF: batches of B,
left-padded, one generate call each). tok/s = completion tokens / wall time (EOS stops every
method alike); per request = the mean over requests of completion tokens / the request's own time;
τ = completion tokens / verify steps; step_ms = the engine's mean speculative step (draft, verify,
commit; prefills apart) and batch = the mean rows per step. Speedup is against spec=off at the same
batch size, suite and method family. Every row carries the hardware, torch version and dtype.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from bench_engine import load, load_drafter, parse_spec, sync, timed_generate
from e2e_bench import read_suite, strip_eos

from eagle3.engine import SpecDecoder
from eagle3.engine.batch import BatchDecoder


def hardware() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"{torch.get_num_threads()} threads {platform.processor() or platform.machine()}"


def engine_load(decoder: BatchDecoder, prompts, batch: int, max_new_tokens: int, eos: int) -> dict:
    """The prompts with `batch` requests in flight; a request joins as one leaves."""
    steps, rows, decode_s, prefill_s = (
        decoder.steps,
        decoder.row_steps,
        decoder.decode_time_s,
        decoder.prefill_time_s,
    )
    queue, running, done = list(prompts), [], []
    sync()
    started = time.perf_counter()
    while queue or running:
        while queue and len(running) < batch:
            running.append(decoder.add(queue.pop(0), max_new_tokens, stop_ids=[eos]))
        decoder.step()
        done += [r for r in running if r.done.is_set()]
        running = [r for r in running if not r.done.is_set()]
    sync()
    wall = time.perf_counter() - started
    results = [r.result for r in done]
    tokens = sum(len(strip_eos(r.tokens, eos)) for r in results)
    verify = sum(r.stats.verify_steps for r in results)
    step_count = max(decoder.steps - steps, 1)
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "tok_per_s_per_request": sum(
            len(strip_eos(r.tokens, eos)) / r.stats.total_time_s for r in results
        )
        / len(results),
        "tau": sum(r.stats.completion_tokens for r in results) / max(verify, 1),
        "steps": decoder.steps - steps,
        "mean_batch": (decoder.row_steps - rows) / step_count,
        "step_ms": 1000 * (decoder.decode_time_s - decode_s) / step_count,
        "prefill_ms_total": 1000 * (decoder.prefill_time_s - prefill_s),
    }


def fused_batch1(decoder: SpecDecoder, prompts, max_new_tokens: int, eos: int) -> dict:
    results, wall = timed_generate(decoder, prompts, max_new_tokens, [eos])
    produced = [len(strip_eos(r.tokens, eos)) for r in results]
    steps = sum(r.stats.verify_steps for r in results)
    return {
        "tokens": sum(produced),
        "wall_s": wall,
        "tok_per_s": sum(produced) / wall,
        "tok_per_s_per_request": sum(n / r.stats.total_time_s for n, r in zip(produced, results))
        / len(results),
        "tau": sum(r.stats.completion_tokens for r in results) / max(steps, 1),
        "steps": steps,
        "mean_batch": 1.0,
    }


def hf_load(model, tokenizer, prompts, batch: int, max_new_tokens: int, eos: int) -> dict:
    """HF generate over left-padded batches of `batch` prompts (greedy)."""
    sync()
    started, tokens, rates = time.perf_counter(), 0, []
    for first in range(0, len(prompts), batch):
        group = prompts[first : first + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in group], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=mask.to(model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        sync()
        elapsed = time.perf_counter() - t0
        for row in out[:, width:].tolist():
            produced = len(strip_eos(row, eos))
            tokens += produced
            rates.append(produced / elapsed)
    wall = time.perf_counter() - started
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "tok_per_s_per_request": sum(rates) / len(rates),
        "mean_batch": float(batch),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True, help="exported drafter folder")
    parser.add_argument("--suites", required=True, help="comma-separated JSONL files")
    parser.add_argument("--specs", default="off,d8,d32s4k8")
    parser.add_argument("--batch-sizes", default="64,16,4,1", help="measured in this order")
    parser.add_argument("--hf-batch-sizes", default="64,16,4,1", help="empty = no HF rows")
    parser.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--waves", type=int, default=2, help="prompts = waves * batch size")
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument("--hf-min-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    parser.add_argument("--deadline", type=float, default=1e9, help="seconds; skip what is left")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    args.random_from = None
    target = load(args)
    drafter = load_drafter(args, target)
    eos = target.tokenizer.eos_token_id
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    hf_batches = [int(b) for b in args.hf_batch_sizes.split(",") if b]
    common = {
        "hardware": hardware(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "temperature": 0.0,
        "max_new_tokens": args.max_new_tokens,
    }
    rows: list[dict] = []
    suites = {Path(p).stem.removeprefix("suite_"): Path(p) for p in args.suites.split(",")}
    prompts = {name: read_suite(path, target.tokenizer, 10**6) for name, path in suites.items()}

    def count(batch: int, floor: int) -> int:
        return max(floor, args.waves * batch)

    def record(row: dict) -> None:
        rows.append({**common, **row})
        keys = ("tok_per_s", "tok_per_s_per_request", "tau", "step_ms", "mean_batch")
        shown = "  ".join(f"{k} {row[k]:.2f}" for k in keys if row.get(k) is not None)
        print(
            f"{row['suite']:>10} {row['method']:>12} bs{row['batch_size']:<3} {shown}", flush=True
        )
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))

    def late() -> bool:
        return time.perf_counter() - started > args.deadline

    specs = [parse_spec(label) for label in args.specs.split(",")]
    decoders = {
        spec.label: BatchDecoder(
            target, drafter if spec.enabled else None, spec, max(batches), args.max_context
        )
        for spec in specs
    }
    for decoder in decoders.values():  # warm-up
        first = prompts[next(iter(prompts))][:4]
        decoder.generate_all([decoder.add(p, 16, stop_ids=[eos]) for p in first])
    for batch in batches:  # in the order given: a deadline cuts the batch sizes listed last
        for suite, ids in prompts.items():
            for label, decoder in decoders.items():
                if late():
                    break
                chosen = ids[: count(batch, args.min_prompts)]
                row = engine_load(decoder, chosen, batch, args.max_new_tokens, eos)
                record(
                    {"suite": suite, "method": label, "path": "batched", "batch_size": batch}
                    | {"prompts": len(chosen)}
                    | row
                )
            if batch in hf_batches and not late():
                chosen = ids[: count(batch, args.hf_min_prompts)]
                row = hf_load(
                    target.model, target.tokenizer, chosen, batch, args.max_new_tokens, eos
                )
                record(
                    {"suite": suite, "method": "hf", "path": "generate", "batch_size": batch}
                    | {"prompts": len(chosen)}
                    | row
                )
    decoders.clear()
    for spec in specs if args.fused else []:
        if late():
            break
        single = SpecDecoder(
            target,
            drafter if spec.enabled else None,
            spec,
            max_context=args.max_context,
            cuda_graphs=args.device == "cuda",
            compile_layers=False,
            compile_draft=False,
            compile_prefill=False,
        )
        for suite, ids in prompts.items():
            chosen = ids[: args.min_prompts]
            row = fused_batch1(single, chosen, args.max_new_tokens, eos)
            record(
                {"suite": suite, "method": spec.label, "path": "fused", "batch_size": 1}
                | {"prompts": len(chosen)}
                | row
            )
    add_speedups(rows)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(json.dumps(totals(rows), indent=1))


def add_speedups(rows: list[dict]) -> None:
    """speedup: tok/s over spec=off's on the same path, suite and batch size (HF rows: over the
    batched engine's spec=off)."""
    off = {
        (r["path"], r["suite"], r["batch_size"]): r["tok_per_s"]
        for r in rows
        if r["method"] == "off"
    }
    for r in rows:
        path = "batched" if r["path"] == "generate" else r["path"]
        base = off.get((path, r["suite"], r["batch_size"]))
        if base:
            r["speedup"] = r["tok_per_s"] / base


def totals(rows: list[dict]) -> list[dict]:
    """Per (method, path, batch size): the suites summed (tokens / wall), τ over all steps."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["method"], r["path"], r["batch_size"])
        t = out.setdefault(key, {"tokens": 0, "wall_s": 0.0, "steps": 0, "step_s": 0.0, "n": 0})
        t["tokens"] += r["tokens"]
        t["wall_s"] += r["wall_s"]
        t["steps"] += r.get("steps") or 0
        t["step_s"] += (r.get("step_ms") or 0) * (r.get("steps") or 0) / 1000
        t["n"] += 1
    result = []
    for (method, path, batch), t in sorted(out.items(), key=lambda item: (item[0][2], item[0][1])):
        result.append(
            {
                "method": method,
                "path": path,
                "batch_size": batch,
                "suites": t["n"],
                "tok_per_s": t["tokens"] / t["wall_s"],
                "step_ms": 1000 * t["step_s"] / t["steps"] if t["step_s"] else None,
            }
        )
    off = {(r["path"], r["batch_size"]): r["tok_per_s"] for r in result if r["method"] == "off"}
    for r in result:
        base = off.get(("batched" if r["path"] == "generate" else r["path"], r["batch_size"]))
        r["speedup"] = r["tok_per_s"] / base if base else None
    return result


if __name__ == "__main__":
    main()
