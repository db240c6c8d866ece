"""`python -m eagle3.pipeline.memory`: the train stage's memory per GPU under DDP and under FSDP for
the composed config, part by part (the pipeline plan's model, eagle3.pipeline.plan.train_gpu, over
trainer.devices x trainer.num_nodes ranks, from the target's and the drafter's shapes); with
pipeline.memory.measure, one real training step per sequence length on pipeline.memory.device, its
peak allocation against the model's one-process total:

    python -m eagle3.pipeline.memory experiment=kimi-k2.5          # 4 GPUs, 4,096 tokens, TTT 5
    python -m eagle3.pipeline.memory experiment=kimi-k2.5 'pipeline.memory.measure=[1024,4096]'
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3.core.common import app
from eagle3.core.config import Config
from eagle3.core.drafter import Eagle3Drafter, drafter_config
from eagle3.pipeline.plan import (
    DrafterTraining,
    drafter_params,
    planned_target,
    train_gpu,
    train_world,
)

STRATEGIES = ("ddp", "fsdp")


def memory_table(training: DrafterTraining) -> dict:
    """{parameters, world, tokens, ddp: {part: GB per GPU}, fsdp: {...}} for this training."""
    params = drafter_params(training.target, training.drafter)
    world = train_world(training.trainer)
    table = {"parameters": params, "world": world, "tokens": int(training.train.max_length)}
    for strategy in STRATEGIES:
        table[strategy] = train_gpu(training.as_strategy(strategy), params, world)
    return table


def table_lines(table: dict) -> list[str]:
    lines = [
        f"drafter: {table['parameters'] / 1e6:,.1f} M trainable parameters; {table['world']} "
        f"rank(s); {table['tokens']:,} tokens a sequence"
    ]
    for strategy in STRATEGIES:
        parts = table[strategy]
        lines.append(f"{strategy.upper()} per GPU (GB):")
        lines += [f"  {name:<20} {gb:8.2f}" for name, gb in parts.items()]
        lines.append(f"  {'total':<20} {sum(parts.values()):8.2f}")
    return lines


def step_batch(rows: int, config: dict, length: int, device: torch.device) -> dict:
    """Random inputs of one training batch (`rows`: train.batch_size, of `length` tokens)."""
    hidden = int(config["hidden_size"])
    states = {"device": device, "dtype": torch.bfloat16}
    return {
        "input_ids": torch.randint(0, int(config["vocab_size"]), (rows, length), device=device),
        "loss_mask": torch.ones(rows, length, dtype=torch.long, device=device),
        "aux_hidden": torch.randn(rows, length, 3 * hidden, **states),
        "last_hidden": torch.randn(rows, length, hidden, **states),
    }


def measure(training: DrafterTraining, device: str, seed: int, lengths: list[int]) -> list[dict]:
    """One process, random weights and inputs: per length the peak allocation of the second of two
        steps (ttt_loss, backward, AdamW; the second holds Adam's states from its start) against the
        model's one-process total at that length (no DDP buckets). Peaks are read on CUDA only (None
    elsewhere; pipeline.memory.device: `device`)."""
    from eagle3.train.ttt import ttt_loss

    config, device, train = training.target.config, torch.device(device), training.train
    torch.manual_seed(seed)
    with torch.device(device):
        drafter = Eagle3Drafter(
            drafter_config(config, training.drafter, training.target.aux_layer_ids)
        ).float()
        head = torch.randn(config["vocab_size"], config["hidden_size"], dtype=torch.bfloat16)
    draft_vocab, vocab = int(training.drafter.draft_vocab_size), int(config["vocab_size"])
    drafter.set_vocab_map(
        torch.zeros(draft_vocab, dtype=torch.long, device=device),
        torch.arange(vocab, device=device) < draft_vocab,
    )
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad])
    params, rows = drafter_params(training.target, training.drafter), []
    for length in lengths:
        batch = step_batch(int(train.batch_size), config, length, device)
        for _ in range(2):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss, _ = ttt_loss(drafter, batch, head, train.ttt_length, train.step_decay)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
        computed = train_gpu(training.as_strategy("ddp", length), params, 1)
        rows.append({"tokens": length, "measured_gb": peak, "computed_gb": sum(computed.values())})
        del batch
    return rows


@app
def main(cfg: Config) -> None:
    target = planned_target(cfg.target, Path(cfg.paths.artifacts))
    training = DrafterTraining(target, cfg.drafter, cfg.train, cfg.trainer, cfg.pipeline.plan)
    table = memory_table(training)
    print("\n".join(table_lines(table)))
    settings = cfg.pipeline.memory
    if settings.measure:
        lengths = [int(length) for length in settings.measure]
        table["measured"] = measure(training, settings.device, cfg.seed, lengths)
        for row in table["measured"]:
            peak = (
                "not read off CUDA"
                if row["measured_gb"] is None
                else f"{row['measured_gb']:.2f} GB"
            )
            print(
                f"{row['tokens']:,} tokens, one process: measured peak {peak}, "
                f"computed {row['computed_gb']:.2f} GB"
            )
    if settings.json:
        Path(settings.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
