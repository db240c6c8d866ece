"""`python -m eagle3.data.prompt_files`: prompt files for a machine without the dataset packages.

Writes the first user turns of the shipped ShareGPT slice as a prompt JSONL
(`{"id", "prompt"}` per line), for regeneration on a machine without the sharegpt package:

    python -m eagle3.data.prompt_files --limit 6000 --max-chars 2000 --out first_turns.jsonl
    python -m eagle3.data data.source=first_turns.jsonl data.regenerate=true ...

--all-turns writes whole conversations instead (`{"id", "messages"}`) with every user turn and a
one-character placeholder for each assistant turn: regeneration replaces every answer, and the
source's own answers would make the file too large to copy to a GPU machine (experiment=smollm2-h200-turns3);
--max-turns N cuts each conversation after its Nth user turn (regeneration is one batched pass per
turn index, so a long tail of deep conversations costs many small, slow passes).

--first-turn-copies K (with --all-turns) adds after each conversation K rows holding its first user turn
alone, ids <id>~1..K: with data.regen.reuse_answers naming the greedy answers of the conversations
themselves, the data stage generates only these, at data.regen.temperature (a second, sampled answer
to every first turn; experiment=smollm2-h200-turns3-sampled).

--suites writes the shipped bench suites instead, as suite_<name>.jsonl (`{"id", "messages"}`) in the
folder --out, for study.suites on a machine without the suites' packages:

    python -m eagle3.data.prompt_files --suites --out suites
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from eagle3.core.common import compose
from eagle3.data.conversations import conversations_for
from eagle3.data.suites import load_suite


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m eagle3.data.prompt_files",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--limit", type=int, default=6000)
    parser.add_argument("--max-chars", type=int, default=2000, help="longest first prompt kept")
    parser.add_argument(
        "--all-turns", action="store_true", help="whole conversations, answers as placeholders"
    )
    parser.add_argument(
        "--max-turns", type=int, default=None, help="with --all-turns: user turns kept"
    )
    parser.add_argument(
        "--first-turn-copies",
        type=int,
        default=0,
        help="with --all-turns: rows repeating each conversation's first user turn alone",
    )
    parser.add_argument(
        "--suites", action="store_true", help="the bench suites, into the folder --out"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.suites:
        for path, count in write_suites(args.out).items():
            print(f"{count} prompts -> {path}")
        return
    written = write_prompts(
        args.out, args.limit, args.max_chars, args.all_turns, args.max_turns, args.first_turn_copies
    )
    print(f"{written} {'conversations' if args.all_turns else 'first turns'} -> {args.out}")


def write_prompts(
    out_path: Path,
    limit: int,
    max_chars: int,
    all_turns: bool = False,
    max_turns: int | None = None,
    first_turn_copies: int = 0,
) -> int:
    """The shipped slice's first turns (or, all_turns, whole conversations) as a prompt JSONL;
    returns how many conversations it wrote."""
    cfg = compose(["data=sharegpt", "data.val_fraction=0"])
    splits = conversations_for(cfg.data, Counter())
    written = 0
    with out_path.open("w") as out:
        for conversation in splits["train"]:
            prompt = next(m["content"] for m in conversation["messages"] if m["role"] == "user")
            if len(prompt) <= max_chars:
                out.write(json.dumps(row_of(conversation, prompt, all_turns, max_turns)) + "\n")
                for copy in range(1, first_turn_copies + 1 if all_turns else 1):
                    row = row_of(
                        {**conversation, "id": f"{conversation['id']}~{copy}"}, prompt, True, 1
                    )
                    out.write(json.dumps(row) + "\n")
                written += 1
            if written == limit:
                break
    return written


def write_suites(folder: Path) -> dict[Path, int]:
    """suite_<name>.jsonl per configured bench suite in `folder`: {file: prompts written}."""
    cfg = compose([])
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in cfg.bench.suites:
        prompts = load_suite(compose([f"bench.suite={name}", "bench.limit=null"]).bench)
        lines = [json.dumps({"id": p.id, "messages": p.messages}) for p in prompts]
        path = folder / f"suite_{name}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        written[path] = len(lines)
    return written


def row_of(conversation: dict, prompt: str, all_turns: bool, max_turns: int | None = None) -> dict:
    if not all_turns:
        return {"id": conversation["id"], "prompt": prompt}
    messages, users = [], 0
    for m in conversation["messages"]:
        users += m["role"] == "user"
        if max_turns is not None and users > max_turns:
            break
        messages.append(m if m["role"] != "assistant" else {"role": "assistant", "content": "."})
    return {"id": conversation["id"], "messages": messages}


if __name__ == "__main__":
    main()
