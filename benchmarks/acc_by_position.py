"""Teacher-forced drafter acceptance on the data stage's val split, per TTT step, broken down by
where the drafted token sits in the response and by whether the response loops.

The metric is the training's val/acc_k (eagle3.train.ttt): at every position t and unroll step k the
drafter's argmax is compared with the target's argmax over the draft vocab for token t+k+2;
a position counts where that token is trained (loss_mask) and the target's full-vocab argmax
lies in the draft vocab. The same hits are also reported with out-of-draft-vocab target tokens
counted as misses (`acc_oov_miss`: the engine can never accept those). Breakdowns:

  position  response index of the drafted token t+k+2, 0 = first assistant token, in buckets
            [0,32) [32,128) [128,256) [256,inf)
  loops     the regenerated response text has a word 8-gram repeated >= 3 times

`chain_sim` replays greedy chain drafting (engine spec dN: N-1 drafts per verify step) along each
response from those teacher-forced hits: a verify step at verified token v accepts the leading
run of step-k hits at position v-1, then moves on by accepted + 1. Its acceptance_per_position
(share of verify steps accepting > j drafts) and tau are what the engine reports, on this data.

    python benchmarks/acc_by_position.py --data /tmp/d5/data/cf7c4fc8fa47 \
        --drafter .h200/export-s4/export/df3d3646650e/sglang \
        --json results/smollm2-135m_h200_2026-11-30c/val_acc_by_position.json

Runs on CPU in float32 (target via eagle3.core.target.load_target, drafter via eagle3.export).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from eagle3.core.common import compose
from eagle3.core.drafter_io import attach_target_embedding, load_drafter
from eagle3.core.target import load_target
from eagle3.data.splits import load_splits
from eagle3.data.vocab import load_vocab_map
from eagle3.train.datamodule import collate
from eagle3.train.ttt import (
    shift_left,
    step_metrics,
    step_targets,
    target_distribution,
    tau_hat,
    ttt_loss,
    unroll,
)

EDGES = (0, 32, 128, 256)
BUCKETS = ("[0,32)", "[32,128)", "[128,256)", "[256,inf)")
CHAINS = (3, 5)  # drafts per verify step: the engine's chain specs d4 and d6


def loops(text: str, n: int = 8, repeats: int = 3) -> bool:
    """Some word n-gram occurs >= `repeats` times in the text."""
    words = text.split()
    counts = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return bool(counts) and max(counts.values()) >= repeats


def regenerated_texts(data_dir: Path) -> dict[str, str]:
    """id -> the target's regenerated first answer (the last record of turn 0 in the turn log)."""
    texts = {}
    for line in (data_dir / "regen" / "turns.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["turn"] == 0 and record["content"] is not None:
            texts[record["id"]] = record["content"]
    return texts


def empty_tally(steps: int) -> torch.Tensor:
    """[steps, loop (0/1), bucket, (hits, counted, trained)] counts."""
    return torch.zeros(steps, 2, len(BUCKETS), 3, dtype=torch.long)


@torch.no_grad()
def tally_batch(
    drafter, target, batch: dict, looping: torch.Tensor, steps: int, tally: torch.Tensor
):
    """Add one batch's per-position hits to `tally` (the same arithmetic as eagle3.train.ttt.ttt_loss);
    returns the hits [B, steps, T] (False past the end) and each row's first response index."""
    aux, last = target.capture(batch["input_ids"], batch["attention_mask"])
    dist = target_distribution(
        last, target.model.get_output_embeddings().weight, drafter.d2t, drafter.t2d
    )
    step_logits = unroll(drafter, batch["input_ids"], aux, steps, "sdpa")
    mask = batch["loss_mask"].bool()
    first = mask.float().argmax(1)  # index of the first assistant token of each row
    hits = torch.zeros(mask.shape[0], steps, mask.shape[1], dtype=torch.bool)
    for k, logits in enumerate(step_logits):
        _, argmax, valid = step_targets(dist, batch["loss_mask"], k)
        count = valid.shape[1]
        hit = (logits[:, :count].argmax(-1) == argmax) & valid
        hits[:, k, :count] = hit
        trained = shift_left(mask, k + 2, fill=False)[:, :count]
        response_index = torch.arange(count)[None, :] + k + 2 - first[:, None]
        bucket = torch.bucketize(response_index, torch.tensor(EDGES[1:]), right=True)
        cell = (looping[:, None].long() * len(BUCKETS) + bucket)[trained]
        for column, flags in enumerate((hit, valid, trained)):
            tally[k, :, :, column] += (
                torch.bincount(cell, weights=flags[trained].double(), minlength=2 * len(BUCKETS))
                .long()
                .view(2, -1)
            )
    return hits, first


def replay_chain(
    hits: torch.Tensor, first: int, end: int, drafts: int, window: int | None
) -> list[int]:
    """Accepted drafts per verify step of a greedy chain of `drafts` along one response: tokens
    first..end-1, the first one from prefill, stopping once `window` tokens are generated."""
    stop = end if window is None else min(end, first + window)
    accepted, verified = [], first
    while verified + 1 < stop:
        run = 0
        while run < drafts and bool(hits[run, verified - 1]):
            run += 1
        accepted.append(run)
        verified += run + 1
    return accepted


def chain_summary(accepted: list[int], drafts: int) -> dict:
    steps = max(len(accepted), 1)
    return {
        "verify_steps": len(accepted),
        "tau": (sum(accepted) + len(accepted)) / steps,
        "acceptance_per_position": [sum(a > j for a in accepted) / steps for j in range(drafts)],
    }


def summarize(tally: torch.Tensor) -> dict:
    """Per-step accuracies of a [steps, (hits, counted, trained)] tally."""
    hits, counted, trained = tally.unbind(-1)
    acc = (hits / counted.clamp(min=1)).tolist()
    return {
        "acc": acc,
        "tau_hat": float(tau_hat(acc)),
        "acc_oov_miss": (hits / trained.clamp(min=1)).tolist(),
        "tau_hat_oov_miss": float(tau_hat((hits / trained.clamp(min=1)).tolist())),
        "counted_positions": counted.tolist(),
        "trained_positions": trained.tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data", required=True, help="data stage folder (dataset/, regen/, vocab_map.safetensors)"
    )
    parser.add_argument(
        "--drafter", required=True, help="exported drafter folder (sglang/ or the export root)"
    )
    parser.add_argument(
        "--artifacts",
        default="/tmp/acc_by_position/artifacts",
        help="paths.artifacts for the target (the GGUF is converted there once)",
    )
    parser.add_argument("--target", default="smollm2-135m", help="conf/target option")
    parser.add_argument("--split", default="val")
    parser.add_argument(
        "--limit", type=int, default=None, help="first N rows of the split (default: all)"
    )
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=1024, help="as train.max_length")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", required=True, help="output JSON file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    cfg = compose(
        [
            f"target={args.target}",
            "target.dtype=float32",
            "target.device=cpu",
            f"paths.artifacts={args.artifacts}",
        ]
    )
    target = load_target(cfg.target, cfg.paths.artifacts, device="cpu")
    drafter = (
        attach_target_embedding(load_drafter(args.drafter, device="cpu"), target).float().eval()
    )
    steps = int(drafter.config.recipe["ttt_length"])
    d2t, t2d = load_vocab_map(Path(args.data))
    same_vocab_map = bool(torch.equal(d2t, drafter.d2t) and torch.equal(t2d, drafter.t2d))

    split = load_splits(args.data)[args.split]
    rows = split.select(range(min(args.limit or len(split), len(split))))
    texts = regenerated_texts(Path(args.data))
    looping = torch.tensor([loops(texts[i]) for i in rows["id"]])
    order = sorted(
        range(len(rows)), key=lambda i: len(rows[i]["input_ids"])
    )  # length-bucketed batches
    pad_id = target.tokenizer.pad_token_id or 0
    tally, check, replays = empty_tally(steps), None, defaultdict(list)
    for begin in range(0, len(order), args.batch_size):
        indices = order[begin : begin + args.batch_size]
        items = [
            {
                "id": rows[i]["id"],
                "input_ids": torch.tensor(rows[i]["input_ids"]),
                "loss_mask": torch.tensor(rows[i]["loss_mask"]),
            }
            for i in indices
        ]
        batch = collate(items, args.max_length, pad_id)
        before = tally.clone()
        hits, first = tally_batch(drafter, target, batch, looping[indices], steps, tally)
        for row, index in enumerate(indices):
            end = len(rows[index]["loss_mask"]) - rows[index]["loss_mask"][::-1].index(1)
            for drafts in CHAINS:
                for window in (128, None):
                    replays[(drafts, window, bool(looping[index]))] += replay_chain(
                        hits[row], int(first[row]), min(end, args.max_length), drafts, window
                    )
        if check is None:  # the first batch through the training's own ttt_loss: same counts?
            aux, last = target.capture(batch["input_ids"], batch["attention_mask"])
            _, counts = ttt_loss(
                drafter,
                {**batch, "aux_hidden": aux, "last_hidden": last},
                target.model.get_output_embeddings().weight,
                steps,
                0.8,
            )
            metrics = step_metrics(counts)
            mine = (tally - before)[..., :2].sum((1, 2))
            check = all(
                metrics[f"correct_{k}"] == mine[k, 0] and metrics[f"count_{k}"] == mine[k, 1]
                for k in range(steps)
            )
        print(
            f"\r{begin + len(indices)}/{len(rows)} rows  {time.perf_counter() - started:.0f}s",
            end="",
            flush=True,
        )
    print()

    result = {
        "args": vars(args),
        "rows": len(rows),
        "looping_rows": int(looping.sum()),
        "ttt_length": steps,
        "vocab_map_matches_data": same_vocab_map,
        "first_batch_matches_ttt_loss": check,
        "buckets": list(BUCKETS),
        "seconds": time.perf_counter() - started,
        "overall": summarize(tally.sum((1, 2))),
        "by_loop": {
            name: summarize(tally[:, flag].sum(1)) for flag, name in ((0, "no_loop"), (1, "loop"))
        },
        "by_position": {b: summarize(tally[:, :, j].sum(1)) for j, b in enumerate(BUCKETS)},
        "first_128": {
            "all": summarize(tally[:, :, :2].sum((1, 2))),
            "no_loop": summarize(tally[:, 0, :2].sum(1)),
            "loop": summarize(tally[:, 1, :2].sum(1)),
        },
        "by_loop_and_position": {
            f"{name} {b}": summarize(tally[:, flag, j])
            for flag, name in ((0, "no_loop"), (1, "loop"))
            for j, b in enumerate(BUCKETS)
        },
        "chain_sim": {
            f"d{drafts + 1}": {
                ("first_128" if window else "all_tokens"): {
                    name: chain_summary(
                        sum((replays[(drafts, window, flag)] for flag in flags), []), drafts
                    )
                    for name, flags in (
                        ("all", (False, True)),
                        ("no_loop", (False,)),
                        ("loop", (True,)),
                    )
                }
                for window in (128, None)
            }
            for drafts in CHAINS
        },
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))

    print(
        f"{len(rows)} rows ({int(looping.sum())} looping), {result['seconds']:.0f}s; vocab map == data's: "
        f"{same_vocab_map}; first batch == ttt_loss: {check}"
    )
    print(
        f"{'slice':<28}{'positions':>10}  {'acc per TTT step':<42}{'tau_hat':>8}  {'acc0 oov=miss':>13}"
    )
    groups = [
        ("overall", result["overall"]),
        *result["by_loop"].items(),
        *result["by_position"].items(),
        *((f"[0,128) {name}", v) for name, v in result["first_128"].items()),
        *result["by_loop_and_position"].items(),
    ]
    for name, s in groups:
        accs = " ".join(f"{a:.2f}" for a in s["acc"])
        print(
            f"{name:<28}{s['counted_positions'][0]:>10}  {accs:<42}{s['tau_hat']:>8.2f}  {s['acc_oov_miss'][0]:>13.2f}"
        )
    print("chain replay (engine-style: share of verify steps accepting > j drafts; tau):")
    for spec, windows in result["chain_sim"].items():
        for window, groups in windows.items():
            for name, c in groups.items():
                accs = " ".join(f"{a:.2f}" for a in c["acceptance_per_position"])
                print(
                    f"  {spec} {window:<10} {name:<8} steps {c['verify_steps']:>6}  accept {accs:<30} tau {c['tau']:.2f}"
                )


if __name__ == "__main__":
    main()
