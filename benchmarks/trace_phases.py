"""Where a decode step's GPU time goes, per CUDA graph replay, from bench_engine's profiler trace.

bench_engine.py --profile LABEL --json X.json writes X.trace_LABEL.json (gzip it to copy it back)
and this report as X.phases_LABEL.txt. Every kernel a replayed graph runs shares the replay's
correlation id, so replays group by phase (kernel count), each with its replays, busy time (kernels)
and span (first start to last end); --kernels N (or --all) lists one replay's kernels:

    python benchmarks/trace_phases.py engine.trace_d32s4k8.json.gz [--kernels 105 | --all]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict


def graph_replays(trace: dict) -> list[list[dict]]:
    """The kernels (and memsets/copies) of each cudaGraphLaunch, in start order."""
    events = trace["traceEvents"]
    by_launch = defaultdict(list)
    for event in events:
        if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            by_launch[event["args"].get("correlation")].append(event)
    launches = [e for e in events if e.get("name", "").startswith("cudaGraphLaunch")]
    return [
        sorted(by_launch[e["args"]["correlation"]], key=lambda k: k["ts"])
        for e in launches
        if by_launch.get(e["args"].get("correlation"))
    ]


def by_count(replays: list[list[dict]]) -> dict[int, list[list[dict]]]:
    """Replays grouped by their kernel count (a phase at one width), in count order."""
    groups = defaultdict(list)
    for kernels in replays:
        groups[len(kernels)].append(kernels)
    return dict(sorted(groups.items()))


def summarize(groups: dict[int, list[list[dict]]]) -> list[dict]:
    """One row per kernel count: replays, mean busy and span µs."""
    rows = []
    for count, group in groups.items():
        busy = sum(sum(k["dur"] for k in kernels) for kernels in group) / len(group)
        span = sum(
            kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"] for kernels in group
        ) / len(group)
        rows.append({"kernels": count, "replays": len(group), "busy_us": busy, "span_us": span})
    return rows


def report(replays: list[list[dict]], listed: list[int] | None = None) -> str:
    """The summary table, then the kernels of one (middle) replay of each listed kernel count (None: all)."""
    groups = by_count(replays)
    lines = [
        f"{row['kernels']:5d} kernels  x{row['replays']:<4d} busy {row['busy_us']:8.1f} µs  "
        f"span {row['span_us']:8.1f} µs"
        for row in summarize(groups)
    ]
    for count in groups if listed is None else listed:
        if count in groups:
            kernels = groups[count][len(groups[count]) // 2]
            lines += [f"-- a replay of {count} kernels"] + [
                f"{k['ts'] - kernels[0]['ts']:8.1f} {k['dur']:6.1f}  {k['name'][:100]}"
                for k in kernels
            ]
    return "\n".join(lines) + "\n"


def load(path: str) -> list[list[dict]]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return graph_replays(json.load(f))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", help="chrome trace (.json or .json.gz)")
    parser.add_argument(
        "--kernels", type=int, nargs="*", default=[], help="list one replay with this many kernels"
    )
    parser.add_argument("--all", action="store_true", help="list one replay of every kernel count")
    args = parser.parse_args()
    replays = load(args.trace)
    print(report(replays, None if args.all else args.kernels), end="")


if __name__ == "__main__":
    main()
