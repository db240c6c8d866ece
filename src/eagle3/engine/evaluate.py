"""Measured acceptance of a drafter: greedy speculative decoding over a prompt set.

Used by the train stage at validation (`val/tau_measured`, next to the simulated tau_hat)
and by anyone comparing drafters without starting a server.
"""

from __future__ import annotations

from tqdm import tqdm

from eagle3.core.spec import Spec
from eagle3.core.target import Target
from eagle3.engine.decoder import DecodeRequest, RequestStats, SpecDecoder
from eagle3.engine.options import DecoderOptions


def summarize(stats: list[RequestStats]) -> dict:
    """Totals over requests: tau = completion tokens / verify steps, acceptance per draft position."""
    completion = sum(s.completion_tokens for s in stats)
    steps = sum(s.verify_steps for s in stats)
    positions = max((s.draft_tokens_per_step for s in stats), default=0)
    per_position = [
        sum(s.accepted_per_position[i] for s in stats if i < s.draft_tokens_per_step)
        for i in range(positions)
    ]
    elapsed = sum(s.total_time_s for s in stats)
    return {
        "requests": len(stats),
        "prompt_tokens": sum(s.prompt_tokens for s in stats),
        "completion_tokens": completion,
        "verify_steps": steps,
        "tau": completion / steps if steps else 0.0,
        "accepted_tokens": sum(sum(s.accepted_per_step) for s in stats),
        "acceptance_per_position": [count / steps if steps else 0.0 for count in per_position],
        "prefill_time_s": sum(s.prefill_time_s for s in stats),
        "draft_time_s": sum(s.draft_time_s for s in stats),
        "verify_time_s": sum(s.verify_time_s for s in stats),
        "tokens_per_s": completion / elapsed if elapsed else 0.0,
    }


def measure_acceptance(
    target: Target,
    drafter,
    prompts: list[list[int]],
    spec: Spec,
    max_new_tokens: int,
    max_context: int | None = None,
    progress: bool = False,
    tree_temperature: float = 1.0,
) -> dict:
    """Greedy-decode every prompt with speculation `spec`; the summary of summarize()."""
    options = DecoderOptions(max_context=max_context, tree_temperature=tree_temperature)
    decoder = SpecDecoder(target, drafter, spec, options)
    stop_ids = (
        [target.tokenizer.eos_token_id]
        if getattr(target.tokenizer, "eos_token_id", None) is not None
        else []
    )
    stats = []
    for prompt in tqdm(prompts, desc=f"measuring acceptance ({spec.label})", disable=not progress):
        usable = prompt[-(decoder.max_context - 1) :]
        stats.append(
            decoder.generate(DecodeRequest(usable, max_new_tokens, stop_ids=stop_ids)).stats
        )
    return summarize(stats)
