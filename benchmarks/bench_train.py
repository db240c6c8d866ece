"""Training-step throughput and peak memory of the TTT unroll (forward + backward + AdamW).

    python benchmarks/bench_train.py                      # CPU grid: tiny-llama, smollm2-135m x T=512,1024 x sdpa
    python benchmarks/bench_train.py --config-json c.json --device cuda --lengths 2048 --paths sdpa flex
    python benchmarks/bench_train.py --check-flex --device cuda   # sdpa vs flex: loss and gradients
    # the train stage's shape (batch 16) with a kernel table of where the step's time goes
    python benchmarks/bench_train.py --config-json c.json --device cuda --lengths 512 --batch 16 \
        --draft-vocab 8192 --profile prof.txt
    # the step with no host read, lengths padded to buckets, fused AdamW (train.length_buckets, train.adamw)
    python benchmarks/bench_train.py --vary --no-sync --buckets 128 256 512 --adamw fused

Shapes come from a target's config.json (`--config-json`) or from eagle3's target loader
(`--targets`, CPU). Inputs are random (aux/final states, token ids): throughput and memory
depend on shapes only. Each (target, T, path) runs in its own process so the CPU peak RSS
(ru_maxrss) is that configuration's alone; on CUDA the peak is max_memory_allocated.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


class Section(dict):
    """A dict read both as cfg.get(name) and cfg.name (what drafter_config expects)."""

    __getattr__ = dict.get


def target_config(name: str | None, config_json: str | None) -> dict:
    if config_json:
        return json.loads(Path(config_json).read_text())
    from eagle3.core.common import compose
    from eagle3.core.target import resolve_target_path

    cfg = compose([f"target={name}"])
    return json.loads(
        (
            Path(resolve_target_path(cfg.target, Path(cfg.paths.artifacts))) / "config.json"
        ).read_text()
    )


def make_drafter(config: dict, draft_vocab: int, device: str):
    from eagle3.core.drafter import Eagle3Drafter, drafter_config

    layers = config["num_hidden_layers"]
    dcfg = Section(num_layers=1, draft_vocab_size=draft_vocab)
    drafter = Eagle3Drafter(drafter_config(config, dcfg, [2, layers // 2, layers - 3])).to(device)
    generator = torch.Generator().manual_seed(0)
    chosen = torch.randperm(config["vocab_size"], generator=generator)[:draft_vocab].sort().values
    t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
    t2d[chosen] = True
    drafter.set_vocab_map((chosen - torch.arange(draft_vocab)).to(device), t2d.to(device))
    return drafter


def random_batch(config: dict, length: int, device: str, batch: int = 1) -> dict:
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    return {
        "input_ids": torch.randint(0, vocab, (batch, length), device=device),
        "loss_mask": torch.ones(batch, length, dtype=torch.long, device=device),
        "aux_hidden": torch.randn(batch, length, 3 * hidden, device=device),
        "last_hidden": torch.randn(batch, length, hidden, device=device),
    }


def padded_batch(config: dict, length: int, padded: int, device: str, batch: int) -> dict:
    """A random batch of `length` real tokens a row, right-padded to `padded` (loss_mask 0 there)."""
    rows = random_batch(config, padded, device, batch)
    rows["loss_mask"][:, length:] = 0
    return rows


def write_profile(step, device: str, path: str, steps: int = 2) -> None:
    """The top kernels/ops of `steps` training steps by self time (CUDA time on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - started) * 1e3
    averages = prof.key_averages()
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    on_device = [e for e in averages if e.device_type != torch.autograd.DeviceType.CPU]
    busy_ms = sum(event.self_device_time_total for event in on_device) / 1e3
    kernels = sum(event.count for event in on_device)
    cpu_ms = averages.self_cpu_time_total / 1e3
    summary = (
        f"{steps} steps: wall {wall_ms:.1f} ms (profiler on), CPU ops {cpu_ms:.1f} ms, device "
        f"busy {busy_ms:.1f} ms ({busy_ms / wall_ms:.0%}), {kernels / steps:.0f} kernels a step\n"
    )
    Path(path).write_text(summary + averages.table(sort_by=key, row_limit=50))


def random_target(config: dict, device: str):
    """A random-weight target with the config's shapes (bf16 on GPU), as the online train stage runs it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return LlamaForCausalLM(LlamaConfig(**config)).to(device=device, dtype=dtype).eval()


def use_gqa_with_mask() -> None:
    """Path "sdpa-gqa": the drafter's attention as it was (enable_gqa together with the mask), to
    compare against repeating the KV heads."""
    import torch.nn.functional as F

    import eagle3.train.ttt as ttt

    ttt.sdpa = lambda q, k, v, mask: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=True
    )


def measure(
    config: dict,
    length: int,
    path: str,
    ttt: int,
    steps: int,
    device: str,
    draft_vocab: int,
    batch_size: int = 1,
    profile_path: str | None = None,
    online: bool = False,
    vary: bool = False,
    cudnn: bool = True,
    compile_loss: bool = False,
    compile_unroll: bool = False,
    compile_target: bool = False,
    no_sync: bool = False,
    buckets: list[int] | None = None,
    adamw: str = "default",
) -> dict:
    from eagle3.core.target import capture_hidden_states
    from eagle3.train.datamodule import padded_length
    from eagle3.train.drafter_module import adamw_options
    from eagle3.train.ttt import step_metrics, ttt_loss

    label = path
    if path == "sdpa-gqa":
        use_gqa_with_mask()
        path = "sdpa"
    drafter = make_drafter(config, draft_vocab, device)
    head = torch.randn(config["vocab_size"], config["hidden_size"], device=device) * 0.05
    optimizer = torch.optim.AdamW(
        [p for p in drafter.parameters() if p.requires_grad],
        **adamw_options(adamw, 1e-4, torch.device(device)),
    )
    if device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
    # vary: every step a new length (length, length - 8, ...), as the train stage's length buckets give
    lengths = [length - 8 * i if vary else length for i in range(steps + 1)]
    # buckets: each batch padded up to its bucket (the padding masked out of the loss)
    schedule = iter(
        [
            padded_batch(config, n, padded_length(n, length, buckets), device, batch_size)
            for n in lengths
        ]
    )
    batch = None
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")
    target = random_target(config, device) if online else None
    layers = config["num_hidden_layers"]
    aux_ids = [2, layers // 2, layers - 3]
    capture = lambda ids: capture_hidden_states(target, ids, aux_ids)  # noqa: E731
    if compile_target:
        from eagle3.core.target import CompiledCapture

        capture = CompiledCapture(target, aux_ids)

    def step():
        nonlocal batch
        batch = next(schedule, batch)  # the profiled steps after the schedule repeat the last batch
        with autocast:
            if target is not None:  # the online stage's target forward for the hidden states
                aux, last = capture(batch["input_ids"])
                batch.update(aux_hidden=aux, last_hidden=last)
            loss, counts = ttt_loss(
                drafter,
                batch,
                head,
                ttt,
                0.8,
                attention=path,
                compile_loss=compile_loss,
                compile_unroll=compile_unroll,
            )
        if not no_sync:  # the metrics read to the host every step
            step_metrics(counts)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up (and compilation on GPU)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / steps
    peak = (
        torch.cuda.max_memory_allocated()
        if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    if profile_path:
        write_profile(step, device, profile_path)
    mean_length = sum(lengths[1:]) / steps
    return {
        "T": length,
        "batch": batch_size,
        "path": label,
        "online": online,
        "vary": vary,
        "cudnn": cudnn,
        "compile_loss": compile_loss,
        "compile_unroll": compile_unroll,
        "compile_target": compile_target,
        "no_sync": no_sync,
        "buckets": buckets,
        "adamw": adamw,
        "ttt": ttt,
        "s_per_step": round(seconds, 4),
        "samples_per_s": round(batch_size / seconds, 1),
        "tokens_per_s": round(batch_size * mean_length / seconds, 1),
        "peak_GiB": round(peak / 2**30, 3),
        "peak_kind": "cuda max_memory_allocated" if device == "cuda" else "process max RSS",
    }


def check_flex(config: dict, length: int, ttt: int, device: str, draft_vocab: int) -> dict:
    """sdpa vs flex on the same random inputs (float32): loss and every gradient."""
    from eagle3.train.ttt import step_metrics, ttt_loss

    drafter = make_drafter(config, draft_vocab, device)
    head = torch.randn(config["vocab_size"], config["hidden_size"], device=device) * 0.05
    batch = random_batch(config, length, device)
    results = {}
    for path in ("sdpa", "flex"):
        drafter.zero_grad()
        loss, counts = ttt_loss(drafter, batch, head, ttt, 0.8, attention=path)
        metrics = step_metrics(counts)
        loss.backward()
        results[path] = (
            loss.detach(),
            metrics,
            {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None},
        )
    worst = max(
        float((results["flex"][2][n] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        for n, g in results["sdpa"][2].items()
    )
    return {
        "T": length,
        "loss_sdpa": float(results["sdpa"][0]),
        "loss_flex": float(results["flex"][0]),
        "max_rel_grad_diff": worst,
        "tau_hat_equal": results["sdpa"][1]["tau_hat"] == results["flex"][1]["tau_hat"],
        "grads_compared": len(results["sdpa"][2]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", nargs="+", default=["tiny-llama", "smollm2-135m"])
    parser.add_argument("--config-json", help="a target's config.json instead of --targets")
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 1024])
    parser.add_argument(
        "--paths",
        nargs="+",
        default=["sdpa"],
        help="sdpa, flex (GPU only) and/or sdpa-gqa (the mask with enable_gqa, for comparison)",
    )
    parser.add_argument(
        "--vary",
        action="store_true",
        help="a new length every step (T, T-8, ...), as the train stage's buckets give",
    )
    parser.add_argument(
        "--cudnn",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="allow cuDNN's fused attention (it builds a graph per new shape)",
    )
    parser.add_argument(
        "--online",
        action="store_true",
        help="include the online stage's target forward (random weights, the config's shapes)",
    )
    parser.add_argument(
        "--compile-loss",
        action="store_true",
        help="the soft cross-entropy torch.compile'd (train.compile_loss)",
    )
    parser.add_argument(
        "--compile-unroll",
        action="store_true",
        help="the drafter's unroll torch.compile'd (train.compile_unroll)",
    )
    parser.add_argument(
        "--compile-target",
        action="store_true",
        help="with --online: the target's forward torch.compile'd (train.compile_target)",
    )
    parser.add_argument(
        "--no-sync",
        action="store_true",
        help="the step reads nothing to the host (no step_metrics, as the train stage's step)",
    )
    parser.add_argument(
        "--buckets",
        nargs="+",
        type=int,
        help="pad each batch up to the first of these lengths that holds it (train.length_buckets)",
    )
    parser.add_argument(
        "--adamw", default="default", help="default | foreach | fused | auto (train.adamw)"
    )
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="sequences per step (the train stage: train.batch_size)",
    )
    parser.add_argument(
        "--profile", help="write a kernel table per configuration to PROFILE.<T>.<path>.txt"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--check-flex", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one configuration, JSON out
    args = parser.parse_args()
    if args.one:
        name, length, path = args.one.split(",")
        config = target_config(name if name != "-" else None, args.config_json)
        profile = f"{args.profile}.{length}.{path}.txt" if args.profile else None
        print(
            json.dumps(
                {
                    "target": name,
                    **measure(
                        config,
                        int(length),
                        path,
                        args.ttt,
                        args.steps,
                        args.device,
                        args.draft_vocab,
                        args.batch,
                        profile,
                        args.online,
                        args.vary,
                        args.cudnn,
                        args.compile_loss,
                        args.compile_unroll,
                        args.compile_target,
                        args.no_sync,
                        args.buckets,
                        args.adamw,
                    ),
                }
            )
        )
        return
    names = ["-"] if args.config_json else args.targets
    if args.check_flex:
        for name in names:
            config = target_config(name if name != "-" else None, args.config_json)
            for length in args.lengths:
                print(
                    json.dumps(
                        {
                            "target": name,
                            **check_flex(config, length, args.ttt, args.device, args.draft_vocab),
                        }
                    ),
                    flush=True,
                )
        return
    for name in names:
        for length in args.lengths:
            for path in args.paths:
                command = [
                    sys.executable,
                    __file__,
                    f"--one={name},{length},{path}",
                    "--ttt",
                    str(args.ttt),
                    "--steps",
                    str(args.steps),
                    "--draft-vocab",
                    str(args.draft_vocab),
                    "--batch",
                    str(args.batch),
                    "--device",
                    args.device,
                ]
                command += ["--profile", args.profile] if args.profile else []
                command += ["--online"] if args.online else []
                command += ["--vary"] if args.vary else []
                command += [] if args.cudnn else ["--no-cudnn"]
                command += ["--compile-loss"] if args.compile_loss else []
                command += ["--compile-unroll"] if args.compile_unroll else []
                command += ["--compile-target"] if args.compile_target else []
                command += ["--no-sync"] if args.no_sync else []
                command += ["--buckets", *map(str, args.buckets)] if args.buckets else []
                command += ["--adamw", args.adamw]
                command += ["--config-json", args.config_json] if args.config_json else []
                done = subprocess.run(command, capture_output=True, text=True)
                lines = done.stdout.strip().splitlines()
                print(
                    lines[-1]
                    if done.returncode == 0 and lines
                    else json.dumps(
                        {
                            "target": name,
                            "T": length,
                            "path": path,
                            "error": done.stderr.strip()[-300:],
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
