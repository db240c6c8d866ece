"""Tokens/s of the embedded decoder for spec=off and several spec shapes, batch 1.

Runs without Hydra (plain argparse), so it also runs on a bare GPU box:

    # the real target with its tokenizer, an exported (or untrained) drafter
    python benchmarks/bench_engine.py --target artifacts/targets/smollm2-135m --drafter untrained
    # timing only: a random model with a target's shapes (acceptance is meaningless there)
    python benchmarks/bench_engine.py --random-from path/to/config.json --device cuda --dtype bfloat16

Per config it prints tok/s, tau, verify steps and the mean draft / verify time per step
(CUDA events on a GPU), the tok/s a drafter with tau = 3, 4, 5 would reach at this step
cost, and whether the greedy tokens equal spec=off's; `--json` writes all rows. Speedup is
against the engine's own spec=off, same run. `--no-fused` times the step-by-step path,
`--no-lean` HF's target forward and the drafter module instead of the engine's lean ones
(engine/llama.py); `--[no-]compile-layers`, `--[no-]compile-draft`, `--[no-]overlap-steps`, `--prefill-graphs`,
`--draft-attention`, `--[no-]compile-prefill`, `--tree-temperature` and `--eager-cudnn` set conf/engine's
compile_layers, compile_draft, overlap_steps, prefill_graphs, draft_attention, compile_prefill, tree_temperature
and eager_cudnn_attention.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from eagle3.core.drafter import build_drafter
from eagle3.core.spec import Spec
from eagle3.core.target import Target, default_aux_layer_ids
from eagle3.engine import DecodeRequest, SpecDecoder, summarize
from eagle3.engine.options import DecoderOptions

ENGINE_CONF = Path(__file__).resolve().parents[1] / "conf" / "engine" / "default.yaml"

PROMPTS = [
    "Explain how a bicycle works.",
    "Write a short poem about the ocean.",
    "What are the main causes of inflation?",
    "Give three tips for learning to code.",
    "Summarise the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
]


def parse_spec(label: str) -> Spec:
    """off | dN (chain of depth N) | dNsSkK (tree: depth N, S steps, top-K)."""
    if label == "off":
        return Spec(False, 1, 0, 1)
    if "s" not in label:
        depth = int(label[1:])
        return Spec(True, depth, depth - 1, 1)
    depth, rest = label[1:].split("s")
    steps, topk = rest.split("k")
    return Spec(True, int(depth), int(steps), int(topk))


def load(args) -> Target:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.random_from:
        config = LlamaConfig(**json.loads(Path(args.random_from).read_text()))
        torch.manual_seed(0)
        model, tokenizer, path = (
            LlamaForCausalLM(config).to(dtype),
            None,
            Path(args.random_from).parent,
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype)
        tokenizer, path = AutoTokenizer.from_pretrained(args.target), Path(args.target)
    model.to(device).eval().requires_grad_(False)
    return Target(model, tokenizer, path, default_aux_layer_ids(model.config.num_hidden_layers))


def load_drafter(args, target: Target):
    dtype = next(target.model.parameters()).dtype
    if args.drafter == "untrained":
        dcfg = SimpleNamespace(num_layers=1, draft_vocab_size=args.draft_vocab_size)
        dcfg.get = lambda name, default=None: getattr(dcfg, name, default)
        torch.manual_seed(0)
        return build_drafter(target, dcfg).to(dtype).eval()
    from eagle3.core.drafter_io import attach_target_embedding
    from eagle3.core.drafter_io import load_drafter as load_exported

    drafter = load_exported(args.drafter, device=target.device)
    if not getattr(drafter.config, "has_embedding", False):
        attach_target_embedding(drafter, target)
    return drafter.to(dtype).eval()


def prompts_for(args, target: Target) -> list[list[int]]:
    if target.tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return [
            torch.randint(0, target.vocab_size, (args.prompt_len,), generator=generator).tolist()
            for _ in range(args.prompts)
        ]
    tok = target.tokenizer
    texts = (PROMPTS * (args.prompts // len(PROMPTS) + 1))[: args.prompts]
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": t}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        for t in texts
    ]


def bench(target, drafter, spec: Spec, prompts, args) -> dict:
    started = time.perf_counter()
    decoder = SpecDecoder(
        target,
        drafter if spec.enabled else None,
        spec,
        DecoderOptions(
            max_context=args.max_context,
            cuda_graphs=args.cuda_graphs,
            fused=args.fused,
            lean=args.lean,
            **engine_options(args),
        ),
    )
    capture_s = time.perf_counter() - started  # graphs (and compiles) are made in the constructor
    stop = [] if args.ignore_eos or target.tokenizer is None else [target.tokenizer.eos_token_id]
    results, elapsed = timed_generate(
        decoder, prompts, args.max_new_tokens, stop, args.warmup_tokens
    )
    stats, tokens = [r.stats for r in results], [r.tokens for r in results]
    if args.profile and spec.label in args.profile.split(","):
        profile(decoder, prompts[0], stop, spec.label, args)
    summary = summarize(stats)
    steps = max(summary["verify_steps"], 1)
    return {
        "spec": spec.label,
        "lean_forward": decoder.target_run.lean is not None,
        "compile_layers": args.compile_layers,
        "compile_draft": args.compile_draft,
        "overlap_steps": args.overlap_steps,
        "draft_attention": args.draft_attention,
        "compile_prefill": args.compile_prefill,
        "tree_temperature": args.tree_temperature,
        "capture_s": capture_s,
        "tok_per_s": summary["completion_tokens"] / elapsed,
        "tau": summary["tau"],
        "completion_tokens": summary["completion_tokens"],
        "verify_steps": summary["verify_steps"],
        "step_ms": 1000 * elapsed / steps,
        "draft_ms_per_step": 1000 * summary["draft_time_s"] / steps,
        "verify_ms_per_step": 1000 * summary["verify_time_s"] / steps,
        "prefill_ms_per_request": 1000 * summary["prefill_time_s"] / len(prompts),
        "acceptance_per_position": summary["acceptance_per_position"],
        "projected_tok_per_s": {tau: 1000 * tau / (elapsed * 1000 / steps) for tau in (3, 4, 5)},
        "tokens": tokens,
    }


def timed_generate(decoder, prompts, max_new_tokens: int, stop_ids, warmup_tokens: int = 16):
    """Warm up on the first prompt (allocator, kernels), then decode every prompt once, one after
    another: (the GenerationResults, wall seconds of the timed pass)."""
    decoder.generate(DecodeRequest(prompts[0], warmup_tokens, stop_ids=stop_ids))
    sync()
    started = time.perf_counter()
    results = [
        decoder.generate(DecodeRequest(p, max_new_tokens, stop_ids=stop_ids)) for p in prompts
    ]
    sync()
    return results, time.perf_counter() - started


def profile(decoder, prompt, stop, label: str, args) -> None:
    """The GPU kernels of one short generation, by total time (where a step's time goes)."""
    from torch.profiler import ProfilerActivity

    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decoder.generate(DecodeRequest(prompt, 32, stop_ids=stop))
        sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    if args.json:
        from trace_phases import graph_replays, report

        stem = Path(args.json)
        stem.with_suffix(f".profile_{label}.txt").write_text(table)
        trace = stem.with_suffix(f".trace_{label}.json")
        prof.export_chrome_trace(str(trace))
        stem.with_suffix(f".phases_{label}.txt").write_text(
            report(graph_replays(json.loads(trace.read_text())))
        )


def read_suite(path: Path, tokenizer, limit: int) -> list[list[int]]:
    """The chat-templated ids of a suite file's first `limit` rows (`python -m eagle3.data.prompt_files --suites`)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:limit]
    return [
        tokenizer.apply_chat_template(
            r["messages"], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for r in rows
    ]


def strip_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine settings both benchmarks expose (conf/engine's names in the help)."""
    parser.add_argument(
        "--eager-cudnn",
        action="store_true",
        help="allow cuDNN attention outside CUDA graphs (prefill; engine.eager_cudnn_attention)",
    )
    parser.add_argument(
        "--compile-layers",
        action=argparse.BooleanOptionalAction,
        default=torch.cuda.is_available(),
        help="fixed-shape verifies run the target's layers torch.compile'd (engine.compile_layers; "
        "default: on a GPU)",
    )
    parser.add_argument(
        "--compile-draft",
        action=argparse.BooleanOptionalAction,
        default=torch.cuda.is_available(),
        help="the fused steps' draft and extend phases run torch.compile'd (engine.compile_draft; "
        "default: on a GPU)",
    )
    parser.add_argument(
        "--overlap-steps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="enqueue each fused step before reading the last one's result (engine.overlap_steps)",
    )
    parser.add_argument(
        "--prefill-graphs",
        default="64,128,256,512,1024",
        help="prefill graph widths (engine.prefill_graphs); empty = eager prefill",
    )
    parser.add_argument(
        "--draft-attention",
        choices=["explicit", "sdpa"],
        default="explicit",
        help="the drafter layer's attention (engine.draft_attention)",
    )
    parser.add_argument(
        "--compile-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the prefill graphs run the target's layers torch.compile'd (engine.compile_prefill)",
    )
    parser.add_argument(
        "--tree-temperature",
        type=float,
        default=yaml.safe_load(ENGINE_CONF.read_text())["tree_temperature"],
        help="trees rank nodes by log_softmax(drafter logits / this) (engine.tree_temperature; "
        "default: conf/engine's)",
    )


def engine_options(args) -> dict:
    """DecoderOptions keyword arguments from add_engine_options' flags."""
    return {
        "eager_cudnn": args.eager_cudnn,
        "compile_layers": args.compile_layers,
        "compile_draft": args.compile_draft,
        "overlap_steps": args.overlap_steps,
        "draft_attention": args.draft_attention,
        "compile_prefill": args.compile_prefill,
        "tree_temperature": args.tree_temperature,
        "prefill_graphs": tuple(int(w) for w in args.prefill_graphs.split(",") if w),
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", help="HF model folder (with tokenizer)")
    source.add_argument(
        "--random-from", help="config.json: a random model with these shapes (timing only)"
    )
    parser.add_argument(
        "--drafter", default="untrained", help="exported drafter folder, or 'untrained'"
    )
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--specs", default="off,d2,d4,d8,d6s3k2,d10s5k4")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    parser.add_argument(
        "--cuda-graphs", action=argparse.BooleanOptionalAction, default=torch.cuda.is_available()
    )
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument(
        "--prompt-len", type=int, default=64, help="random prompts' length (--random-from)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--warmup-tokens", type=int, default=16)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument(
        "--fused",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="greedy steps on the device path (FusedGreedy); --no-fused: step by step",
    )
    parser.add_argument(
        "--lean",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the target and drafter run the engine's lean forwards; --no-lean: HF's and the module's",
    )
    add_engine_options(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument(
        "--profile", default="", help="comma-separated spec labels to profile (torch.profiler)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load(args)
    specs = [parse_spec(s) for s in args.specs.split(",")]
    drafter = load_drafter(args, target) if any(s.enabled for s in specs) else None
    prompts = prompts_for(args, target)
    rows = []
    for spec in specs:
        rows.append(bench(target, drafter, spec, prompts, args))
        base = rows[0]["tok_per_s"] if rows[0]["spec"] == "off" else None
        row = rows[-1]
        if base:  # greedy: same tokens as spec=off, up to low-precision ties between query shapes
            row["same_tokens_as_off"] = sum(
                a == b for a, b in zip(row["tokens"], rows[0]["tokens"])
            )
        speedup = f"  x{row['tok_per_s'] / base:.2f}" if base else ""
        projected = " ".join(f"{v:.0f}" for v in row["projected_tok_per_s"].values())
        print(
            f"{row['spec']:>10}: {row['tok_per_s']:8.1f} tok/s{speedup}  tau {row['tau']:.2f}  "
            f"step {row['step_ms']:.2f} ms (draft {row['draft_ms_per_step']:.2f}, "
            f"verify {row['verify_ms_per_step']:.2f}, prefill {row['prefill_ms_per_request']:.1f}/request)  "
            f"tau=3/4/5 -> {projected} tok/s  same as off {row.get('same_tokens_as_off', '-')}/{len(prompts)}  "
            f"graphs made in {row['capture_s']:.1f} s",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
