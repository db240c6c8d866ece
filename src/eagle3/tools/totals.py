"""All suites together, per method, from engine-loop JSONs of one run: the engine's
headline figures (tok/s and its ratio to spec=off over the three suites). Rows are summed, not their
rates averaged: tok/s = Σ tokens / Σ wall, τ = Σ tokens / Σ verify steps, step = Σ wall / Σ verify
steps (prefill included); draft, verify and prefill times are weighted by steps and prompts.

    python -m eagle3.tools.results totals e2e.json [e2e_deeper.json ...] [--json totals.json]

The ratio is to the spec=off rows of the same files (`off`); without them there is none. A method
measured in two files (variants of one engine setting) is a mistake here: give the files apart.
"""

from __future__ import annotations

from collections import defaultdict

WEIGHTED = {
    "draft_ms_per_step": "verify_steps",
    "verify_ms_per_step": "verify_steps",
    "prefill_ms_per_prompt": "prompts",
}
PHASES = [
    ("draft", "draft_ms_per_step"),
    ("verify", "verify_ms_per_step"),
    ("prefill ms/prompt", "prefill_ms_per_prompt"),
]


def totals(rows: list[dict]) -> list[dict]:
    """One row per method, in first-seen order, with its suites summed; `speedup` against method off."""
    grouped: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        grouped[row["method"]].append(row)
    out = []
    for method, group in grouped.items():
        suites = [r["suite"] for r in group]
        if len(set(suites)) != len(suites):
            raise SystemExit(
                f"{method}: suite measured twice ({sorted(suites)}); give variant files apart"
            )
        tokens, wall = sum(r["tokens"] for r in group), sum(r["wall_s"] for r in group)
        total = {
            "method": method,
            "suites": suites,
            "prompts": sum(r["prompts"] for r in group),
            "tokens": tokens,
            "wall_s": wall,
            "tok_per_s": tokens / wall,
        }
        steps = sum(r.get("verify_steps", 0) for r in group)
        if steps:
            total |= {"tau": tokens / steps, "step_ms": 1000 * wall / steps}
            for key, weight in WEIGHTED.items():
                if all(key in r for r in group):  # files before a phase was timed lack its key
                    total[key] = sum(r[key] * r[weight] for r in group) / sum(
                        r[weight] for r in group
                    )
        out.append(total)
    off = next((t for t in out if t["method"] == "off"), None)
    for total in out:
        if off is not None and total["suites"] == off["suites"]:
            total["speedup"] = total["tok_per_s"] / off["tok_per_s"]
    return out


def report(rows: list[dict]) -> str:
    lines = ["all suites:"]
    for t in rows:
        ratio = f" ({t['speedup']:.3f}x off)" if "speedup" in t else ""
        phases = ", ".join(f"{label} {t[key]:.3f}" for label, key in PHASES if key in t)
        steps = f"  tau {t['tau']:.3f}  step {t['step_ms']:.3f} ms ({phases})" if "tau" in t else ""
        lines.append(f"{t['method']:>10}: {t['tok_per_s']:8.1f} tok/s{ratio}{steps}")
    return "\n".join(lines)
