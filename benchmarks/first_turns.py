"""Write the first user turns of the shipped ShareGPT slice as a prompt JSONL
(`{"id", "prompt"}` per line), for regeneration on a machine without the sharegpt package:

    python benchmarks/first_turns.py --limit 6000 --max-chars 2000 --out first_turns.jsonl
    python -m eagle3.data data.source=first_turns.jsonl data.regenerate=true ...
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from eagle3.common import compose
from eagle3.data import conversations_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=6000)
    parser.add_argument("--max-chars", type=int, default=2000, help="longest first prompt kept")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cfg = compose(["data=sharegpt", "data.val_fraction=0"])
    splits = conversations_for(cfg.data, Counter())
    written = 0
    with args.out.open("w") as out:
        for conversation in splits["train"]:
            prompt = next(m["content"] for m in conversation["messages"] if m["role"] == "user")
            if len(prompt) <= args.max_chars:
                out.write(json.dumps({"id": conversation["id"], "prompt": prompt}) + "\n")
                written += 1
            if written == args.limit:
                break
    print(f"{written} first turns -> {args.out}")


if __name__ == "__main__":
    main()
