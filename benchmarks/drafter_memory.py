"""Per-GPU training memory of a drafter under DDP and FSDP, from its shapes; optionally checked
against one real training step's allocation on a GPU at reduced lengths.

    python benchmarks/drafter_memory.py                       # Kimi-K2.5-sized, 4 GPUs, 4096 tokens
    python benchmarks/drafter_memory.py --measure 512,1024    # on a GPU: measured vs computed

Shapes default to Kimi-K2.5's text model (moonshotai/Kimi-K2.5 config.json: hidden 7168, vocab
163,840, dense intermediate 18,432, 64 heads, 64 KV heads) with experiments/kimi-k2.5's drafter
(one layer, draft vocab 32,000, TTT 5, 4 GPUs, max length 4096, batch 1).

What training holds (train.py: the drafter in float32 under bf16-mixed autocast, Adam):
  trainable   fc [H, 3H], q/k/v [H, 2H], o [H, H], gate/up/down [I, H], 4 norms, lm_head [Vd, H]
  frozen      the embedding [V, H] copied from the target (float32, a parameter without grads)
  buffer      the target's lm_head [V, H] in its dtype, for the soft labels (never sharded)
  DDP         params 4 + grads 4 + gradient buckets 4 + Adam m, v 8 bytes per trainable parameter
  FSDP        params, grads and Adam states of all parameters (the frozen embedding included)
              divided over N GPUs, plus the unsharded bf16 parameters of the unit being computed
              (Lightning's default wraps the drafter as one unit) and their bf16 gradients
  activations per TTT step and token (bytes): 36 H + 8 I + 6 Vd (layer input, q/k/v, attention,
              norms in fp32; MLP gate/up/act/product in bf16; logits bf16 + log-softmax fp32),
              plus the target's draft-vocab probabilities 4 Vd and the aux states 6 H once
"""

from __future__ import annotations

import argparse
import json

GIB = 1024**3


def shapes(args) -> dict[str, int]:
    h, i, v, vd = args.hidden, args.intermediate, args.vocab, args.draft_vocab
    head_dim = h // args.heads
    q, kv = args.heads * head_dim, args.kv_heads * head_dim
    trainable = {
        "fc": 3 * args.target_hidden * h,
        "attention": (q + 2 * kv) * 2 * h + q * h,
        "mlp": 3 * i * h,
        "norms": 4 * h,
        "lm_head": vd * h,
    }
    return {
        **trainable,
        "trainable": sum(trainable.values()),
        "embedding": v * h,
        "target_head": v * args.target_hidden,
    }


def activations(args, length: int) -> int:
    h, i, vd = args.hidden, args.intermediate, args.draft_vocab
    per_step = 36 * h + 8 * i + 6 * vd
    return length * args.batch * (args.ttt * per_step + 4 * vd + 6 * args.target_hidden)


def table(args) -> dict:
    s = shapes(args)
    t, e, n = s["trainable"], s["embedding"], args.gpus
    act = activations(args, args.length)
    head = 2 * s["target_head"]
    ddp = {
        "params (fp32)": 4 * t,
        "grads (fp32)": 4 * t,
        "DDP gradient buckets": 4 * t,
        "Adam m, v (fp32)": 8 * t,
        "frozen embedding (fp32)": 4 * e,
        "target lm_head buffer (bf16)": head,
        f"activations ({args.length} tokens)": act,
    }
    fsdp = {
        f"params (fp32) / {n}": 4 * (t + e) // n,
        f"grads (fp32) / {n}": 4 * t // n,
        f"Adam m, v (fp32) / {n}": 8 * t // n,
        "gathered unit (bf16 params + grads)": 2 * (t + e) + 2 * t,
        "target lm_head buffer (bf16)": head,
        f"activations ({args.length} tokens)": act,
    }
    return {"shapes": s, "ddp": ddp, "fsdp": fsdp}


def print_table(result: dict) -> None:
    s = result["shapes"]
    print("parameters: " + ", ".join(f"{k} {v / 1e6:,.1f}M" for k, v in s.items()))
    for name in ("ddp", "fsdp"):
        rows = result[name]
        print(f"\n{name.upper()} per GPU:")
        for key, value in rows.items():
            print(f"  {key:<40} {value / GIB:8.2f} GiB")
        print(f"  {'total':<40} {sum(rows.values()) / GIB:8.2f} GiB")


def measure(args, lengths: list[int]) -> list[dict]:
    """One real training step (ttt_loss, backward, Adam) of this drafter on the GPU per length:
    peak allocation against the computed DDP total without the DDP buckets (one process)."""
    import torch

    from eagle3.core.drafter import Eagle3Drafter, drafter_config
    from eagle3.train.ttt import ttt_loss

    class Settings(dict):  # drafter.* as drafter_config reads them (attribute and .get access)
        __getattr__ = dict.get

    target = {
        "hidden_size": args.target_hidden,
        "vocab_size": args.vocab,
        "intermediate_size": args.intermediate,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": max(lengths) + args.ttt + 1,
    }
    dcfg = Settings(num_layers=1, draft_vocab_size=args.draft_vocab)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    torch.manual_seed(0)
    with torch.device(device):
        drafter = Eagle3Drafter(drafter_config(target, dcfg, [2, 30, 58])).float()
        head = torch.randn(args.vocab, args.target_hidden, dtype=torch.bfloat16) * 0.02
    drafter.set_vocab_map(
        torch.zeros(args.draft_vocab, dtype=torch.long, device=device),
        torch.arange(args.vocab, device=device) < args.draft_vocab,
    )
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    rows = []
    for length in lengths:
        batch = {
            "input_ids": torch.randint(0, args.vocab, (args.batch, length), device=device),
            "loss_mask": torch.ones(args.batch, length, dtype=torch.long, device=device),
            "aux_hidden": torch.randn(
                args.batch, length, 3 * args.target_hidden, device=device, dtype=torch.bfloat16
            ),
            "last_hidden": torch.randn(
                args.batch, length, args.target_hidden, device=device, dtype=torch.bfloat16
            ),
        }
        for _ in range(2):  # the second step holds Adam's states from the start: the steady peak
            if gpu:
                torch.cuda.reset_peak_memory_stats()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss, _ = ttt_loss(drafter, batch, head, args.ttt, 1.0)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        peak = torch.cuda.max_memory_allocated() if gpu else float("nan")
        args.length = length
        computed = table(args)["ddp"]
        computed.pop("DDP gradient buckets")
        rows.append(
            {
                "length": length,
                "measured_peak_gib": round(peak / GIB, 2),
                "computed_gib": round(sum(computed.values()) / GIB, 2),
                "computed_activations_gib": round(activations(args, length) / GIB, 2),
            }
        )
        print(json.dumps(rows[-1]))
        del batch
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--target-hidden", type=int, default=7168)
    parser.add_argument("--vocab", type=int, default=163840)
    parser.add_argument("--intermediate", type=int, default=18432)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=64)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--ttt", type=int, default=5)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--measure", default="", help="lengths to measure on the GPU, e.g. 512,1024"
    )
    parser.add_argument(
        "--device", default="cuda", help="where --measure runs (peaks on CUDA only)"
    )
    parser.add_argument("--json", default="", help="write the table (and measurements) here")
    args = parser.parse_args()
    result = table(args)
    print_table(result)
    if args.measure:
        result["measured"] = measure(args, [int(x) for x in args.measure.split(",")])
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
