"""More prompts for the data stage, each a data.* option that is off by default (and then absent
from the data hashes): first-turn copies (another, sampled answer to every first turn), prompts
from packaged files other than the bench suites, and prompts the target writes itself.

Copies stay in their conversation's split; packaged and self-written prompts join the train
split only (shuffled in among its rows), so the validation slice (and val tau_hat) stays the same
with or without them. Every added row is a single user turn: the data stage's regeneration
answers it.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

from eagle3.core.common import Eagle3Error, installed_file, log
from eagle3.core.config import DataConfig, ExtraSourceConfig, SelfPromptsConfig, SuiteConfig
from eagle3.data.suites import read_rows

SELF_PROMPT_LOG = "self_prompts.jsonl"


def first_turn_copies(splits: dict[str, list[dict]], copies: int) -> dict[str, list[dict]]:
    """After each conversation, `copies` rows holding its system prompt and first user turn alone,
    ids <id>~1..copies (what python -m eagle3.data.prompt_files --first-turn-copies writes into a file)."""
    if copies <= 0:
        return splits
    expanded = {}
    for name, conversations in splits.items():
        rows = []
        for conversation in conversations:
            rows.append(conversation)
            first = first_turn(conversation["messages"])
            rows += [
                {"id": f"{conversation['id']}~{k}", "messages": first} for k in range(1, copies + 1)
            ]
        expanded[name] = rows
    return expanded


def first_turn(messages: list[dict]) -> list[dict]:
    system = [m for m in messages[:1] if m["role"] == "system"]
    return system + [next(m for m in messages if m["role"] == "user")]


def check_not_a_suite(source: ExtraSourceConfig, suites: dict[str, SuiteConfig]) -> None:
    """Refuse a packaged source that reads a bench suite's file (the suites measure the drafter)."""
    for name, suite in suites.items():
        if suite.package != source.package or Path(suite.file).name != Path(source.file).name:
            continue
        wanted = dict(source.where or {})
        suite_where = dict(suite.where or {})
        if not suite_where or all(wanted.get(k) == v for k, v in suite_where.items()):
            raise Eagle3Error(
                f"data.extra_sources entry {source.package}/{source.file} where {wanted or 'none'} "
                f"holds bench suite {name}'s prompts: name its other rows (where) or another file"
            )
        if not wanted:
            raise Eagle3Error(
                f"data.extra_sources entry {source.package}/{source.file} without `where` holds bench "
                f"suite {name}'s prompts too (its rows where {suite_where}): add a `where`"
            )


def packaged_prompts(sources, suites: dict[str, SuiteConfig], counts: dict) -> list[dict]:
    """Single-turn prompts from files shipped in installed packages (data.extra_sources): rows whose
    `where` fields match, their `field` text as the user turn; ids <package>:<file stem>:<row index>."""
    conversations = []
    for source in sources:
        check_not_a_suite(source, suites)
        where = dict(source.where or {})
        unless = dict(source.unless or {})
        rows = read_rows(installed_file(source.package, source.file))
        name = f"{source.package}:{Path(source.file).stem}"  # two files of a package: distinct ids
        kept = 0
        for index, row in enumerate(rows):
            if any(row.get(k) != v for k, v in where.items()):
                continue
            if any(row.get(k) == v for k, v in unless.items()):
                continue
            text = row.get(source.field)
            if not isinstance(text, str) or not text.strip():
                raise Eagle3Error(
                    f"data.extra_sources {source.package}/{source.file} row {index}: no string "
                    f"field `{source.field}`"
                )
            conversations.append(
                {"id": f"{name}:{index}", "messages": [{"role": "user", "content": text}]}
            )
            kept += 1
        counts[f"extra_source_{name}"] = counts.get(f"extra_source_{name}", 0) + kept
    return conversations


def self_prompt_requests(scfg: SelfPromptsConfig) -> list[tuple[str, int, list[dict]]]:
    """(id, turn, messages) asking the target to write scfg.count prompts, topics in rotation."""
    topics = list(scfg.topics)
    if not topics:
        raise Eagle3Error("data.self_prompts.topics is empty: name at least one topic")
    return [
        (
            f"self:{index}",
            0,
            [
                {
                    "role": "user",
                    "content": scfg.instruction.format(topic=topics[index % len(topics)]),
                }
            ],
        )
        for index in range(scfg.count)
    ]


def self_prompt_data(dcfg: DataConfig) -> DataConfig:
    """The data settings a generator writes self-prompts under: data.self_prompts's sampling
    settings; a thinking target's prompt is the text after its thinking (reasoning keep becomes
    drop)."""
    scfg = dcfg.self_prompts
    reasoning = dcfg.regen.reasoning
    regen = dataclasses.replace(
        dcfg.regen,
        temperature=scfg.temperature,
        top_p=1.0,
        max_new_tokens=scfg.max_new_tokens,
        seed=scfg.seed,
        reasoning="drop" if reasoning == "keep" else reasoning,
    )
    return dataclasses.replace(dcfg, regen=regen)


def self_written_prompts(
    scfg: SelfPromptsConfig, folder: Path, new_generator: Callable, make_log
) -> list[dict]:
    """The target's own prompts (data.self_prompts), logged in `folder` as they arrive (resumable),
    written by `new_generator()` (generating at self_prompt_data's settings): each written prompt
    becomes a single-turn row, ids self:<index>; empty ones are dropped."""
    requests = self_prompt_requests(scfg)
    prompt_log = make_log(folder / SELF_PROMPT_LOG)
    pending = [r for r in requests if not prompt_log.find(r[0], r[2])[0]]
    if pending:
        new_generator().run(pending, prompt_log, desc="self-written prompts")
    written = [(rid, prompt_log.find(rid, messages)[1]) for rid, _, messages in requests]
    return [
        {"id": rid, "messages": [{"role": "user", "content": text.strip()}]}
        for rid, text in written
        if text and text.strip()
    ]


def more_prompts(
    dcfg: DataConfig,
    suites: dict[str, SuiteConfig],
    splits: dict[str, list[dict]],
    counts: dict,
    folder: Path,
    new_generator: Callable,
    make_log: Callable,
) -> dict[str, list[dict]]:
    """The splits with the configured extra prompts (packaged ones found among bench.suites, `suites`;
    self-written ones by `new_generator()`); counts gets how many of each kind were added."""
    added = bool(dcfg.first_turn_copies) or bool(dcfg.extra_sources) or bool(dcfg.self_prompts)
    if added and not dcfg.regenerate:
        raise Eagle3Error(
            "data.first_turn_copies, data.extra_sources and data.self_prompts add prompts without "
            "answers: set data.regenerate=true"
        )
    splits = first_turn_copies(splits, int(dcfg.first_turn_copies or 0))
    train = list(splits["train"])
    if dcfg.extra_sources:
        extra = packaged_prompts(dcfg.extra_sources, suites, counts)
        train += extra
        counts["extra_source_prompts"] = len(extra)
    if dcfg.self_prompts:
        written = self_written_prompts(dcfg.self_prompts, folder, new_generator, make_log)
        train += written
        counts["self_prompts"] = len(written)
        log.info("data: %d prompts written by the target", len(written))
    if len(train) > len(splits["train"]):
        # among the source's rows, not after them: train.limit's prefixes (the study's nested sizes)
        # then hold every kind of prompt in proportion
        random.Random(dcfg.seed).shuffle(train)
    return {**splits, "train": train}
