"""bench.check_outputs: each greedy output against spec=off's, and where one differs the target's
logit margin between the two tokens."""

from __future__ import annotations

from collections.abc import Callable

import torch

from eagle3.core.common import Eagle3Error
from eagle3.core.config import BenchConfig
from eagle3.core.target import Target


def check_output_settings(bench: BenchConfig, engine_name: str) -> None:
    """bench.check_outputs compares greedy outputs, which only /generate answers carry."""
    if not bench.check_outputs:
        return
    if bench.temperature != 0:
        raise Eagle3Error(
            f"bench.check_outputs=true compares greedy outputs; bench.temperature="
            f"{bench.temperature} samples (set it to 0)"
        )
    if engine_name not in ("local", "sglang"):
        raise Eagle3Error(
            f"bench.check_outputs=true needs output token ids, which serve={engine_name} "
            "does not return; use serve=local or serve=sglang"
        )


def first_divergence(expected: list[int], got: list[int]) -> int | None:
    """The first position where two outputs differ (a longer one differs where the shorter ends)."""
    for index, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return index
    return None if len(expected) == len(got) else min(len(expected), len(got))


def compare_outputs(
    prompts: list[list[int]],
    off: list[list[int]],
    outputs: list[list[int]],
    load_target: Callable[[], Target],
) -> dict:
    """How many outputs equal spec=off's and, per one that differs, where it first does and the
    target's logit margin there (spec=off's token minus this output's; None past either's end);
    load_target() loads the target at the first margin asked for."""
    if len(off) != len(outputs):
        raise Eagle3Error(
            f"bench.check_outputs: spec=off kept {len(off)} outputs and this shape {len(outputs)}; "
            "measure the baseline with check_outputs on (bench.reuse_baseline=false)"
        )
    diverged = []
    logits_at = None
    for index, (prompt, expected, got) in enumerate(zip(prompts, off, outputs)):
        position = first_divergence(expected, got)
        if position is None:
            continue
        entry = {"prompt": index, "position": position, "margin": None}
        if position < min(len(expected), len(got)):
            logits_at = logits_at or target_logits(load_target())
            row = logits_at(prompt + expected[:position])
            entry.update(
                off_token=expected[position],
                token=got[position],
                margin=float(row[expected[position]] - row[got[position]]),
            )
        diverged.append(entry)
    return {
        "outputs_compared": len(off),
        "outputs_equal_off": len(off) - len(diverged),
        "output_divergences": diverged,
    }


def target_logits(target: Target):
    """ids -> the target's next-token logits (float32) after them."""

    @torch.inference_mode()
    def logits(ids: list[int]) -> torch.Tensor:
        tensor = torch.tensor([ids], device=target.device)
        return target.model(tensor).logits[0, -1].float().cpu()

    return logits


def output_check_line(label: str, check: dict) -> str:
    line = (
        f"{label}: {check['outputs_equal_off']} of {check['outputs_compared']} outputs equal "
        "spec=off's"
    )
    for entry in check["output_divergences"]:
        margin = "" if entry["margin"] is None else f", logit margin {entry['margin']:.4g}"
        line += f"; prompt {entry['prompt']} from token {entry['position']}{margin}"
    return line
