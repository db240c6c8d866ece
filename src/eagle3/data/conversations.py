"""Normalising raw rows into conversations (roles, system policy, turn order), filtering them and
splitting them into train and val."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

from eagle3.core.common import Eagle3Error
from eagle3.core.config import DataConfig, FiltersConfig, NormaliseConfig
from eagle3.data.sources import read_rows

ROLE_NAMES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}


class BadRow(Exception):
    """A row that cannot become a conversation; the message is the reason counted."""


def normalise_row(row: Any, index: int, ncfg: NormaliseConfig, regenerate: bool) -> dict:
    """One source row -> {"id", "messages": [{"role", "content"}]} or BadRow(reason)."""
    if not isinstance(row, dict):
        raise BadRow("not_an_object")
    if "messages" in row:
        messages = [message_of(m, "role", "content") for m in list_of(row["messages"])]
    elif "conversations" in row:
        messages = [message_of(m, "from", "value") for m in list_of(row["conversations"])]
    elif "prompt" in row:
        messages = [message_of({"role": "user", "content": row["prompt"]}, "role", "content")]
    else:
        raise BadRow("no_messages")
    messages = apply_system_policy(messages, ncfg)
    if ncfg.drop_leading_assistant:
        messages = drop_leading_assistant(messages)
    check_order(messages)
    if not regenerate:  # a final user turn without an answer teaches nothing
        while messages and messages[-1]["role"] == "user":
            messages.pop()
        if not any(m["role"] == "assistant" for m in messages):
            raise BadRow("no_assistant_turn")
    row_id = row.get("id")
    return {
        "id": row_id if isinstance(row_id, str) and row_id else f"row-{index}",
        "messages": messages,
    }


def list_of(value: Any) -> list:
    if not isinstance(value, list):
        raise BadRow("wrong_type")
    return value


def message_of(item: Any, role_key: str, content_key: str) -> dict:
    if not isinstance(item, dict):
        raise BadRow("wrong_type")
    role, content = item.get(role_key), item.get(content_key)
    if role is None or role == "":
        raise BadRow("missing_role")
    if not isinstance(role, str) or not isinstance(content, (str, type(None))):
        raise BadRow("wrong_type")
    if role.lower() not in ROLE_NAMES:
        raise BadRow("unknown_role")
    if content is None or not content.strip():
        raise BadRow("empty_content")
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: invalid UTF-8 bytes in the source
        raise BadRow("invalid_utf8") from None
    return {"role": ROLE_NAMES[role.lower()], "content": content}


def apply_system_policy(messages: list[dict], ncfg: NormaliseConfig) -> list[dict]:
    if ncfg.system_policy not in ("keep", "drop", "replace"):
        raise Eagle3Error(
            f"data.normalise.system_policy={ncfg.system_policy}: use keep, drop or replace"
        )
    if ncfg.system_policy == "keep":
        return messages
    rest = [m for i, m in enumerate(messages) if not (i == 0 and m["role"] == "system")]
    if ncfg.system_policy == "drop":
        return rest
    if not ncfg.system_prompt:
        raise Eagle3Error("data.normalise.system_policy=replace needs data.normalise.system_prompt")
    return [{"role": "system", "content": str(ncfg.system_prompt)}, *rest]


def drop_leading_assistant(messages: list[dict]) -> list[dict]:
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    body = messages[len(head) :]
    while body and body[0]["role"] == "assistant":
        body = body[1:]
    return head + body


def check_order(messages: list[dict]) -> None:
    """An optional system prompt first, then user/assistant alternating from a user turn."""
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if not body:
        raise BadRow("no_turns")
    for i, message in enumerate(body):
        if message["role"] != ("user" if i % 2 == 0 else "assistant"):
            raise BadRow("roles_out_of_order")


def normalise(rows: Iterable[Any], dcfg: DataConfig, counts: Counter) -> list[dict]:
    conversations, seen_ids = [], set()
    for index, row in enumerate(rows):
        counts["rows"] += 1
        try:
            conversation = normalise_row(row, index, dcfg.normalise, dcfg.regenerate)
        except BadRow as bad:
            counts[f"bad_{bad}"] += 1
            continue
        if conversation["id"] in seen_ids:  # ids key regeneration results: they must be unique
            conversation["id"] = f"{conversation['id']}#{index}"
        seen_ids.add(conversation["id"])
        conversations.append(conversation)
    counts["normalised"] = len(conversations)
    return conversations


def user_turns(conversation: dict) -> int:
    return sum(m["role"] == "user" for m in conversation["messages"])


def apply_filters(conversations: list[dict], fcfg: FiltersConfig, counts: dict) -> list[dict]:
    """Each filter in order; counts[f'after_{name}'] records what survives it."""

    def first_prompt(c):
        return next(m["content"] for m in c["messages"] if m["role"] == "user")

    filters = [
        ("min_turns", fcfg.min_turns, lambda c: user_turns(c) >= fcfg.min_turns),
        ("max_turns", fcfg.max_turns, lambda c: user_turns(c) <= fcfg.max_turns),
        (
            "max_chars",
            fcfg.max_chars,
            lambda c: sum(len(m["content"]) for m in c["messages"]) <= fcfg.max_chars,
        ),
    ]
    for name, setting, keep in filters:
        if setting is not None:
            conversations = [c for c in conversations if keep(c)]
            counts[f"after_{name}"] = len(conversations)
    if fcfg.dedup_first_prompt:
        seen, unique = set(), []
        for c in conversations:
            if first_prompt(c) not in seen:
                seen.add(first_prompt(c))
                unique.append(c)
        conversations = unique
        counts["after_dedup_first_prompt"] = len(conversations)
    return conversations


def split_conversations(
    conversations: list[dict], dcfg: DataConfig, counts: dict
) -> dict[str, list[dict]]:
    """Seeded shuffle, limit, then a held-out validation slice."""
    order = list(range(len(conversations)))
    random.Random(dcfg.seed).shuffle(order)
    if dcfg.limit is not None:
        order = order[: dcfg.limit]
        counts["after_limit"] = len(order)
    chosen = [conversations[i] for i in order]
    n_val = int(round(len(chosen) * dcfg.val_fraction))
    if dcfg.val_fraction > 0 and len(chosen) > 1:
        n_val = min(max(n_val, 1), len(chosen) - 1)
    return {"train": chosen[n_val:], "val": chosen[:n_val]}


def conversations_for(dcfg: DataConfig, counts: dict) -> dict[str, list[dict]]:
    """Read, normalise, filter and split the configured source."""
    raw_counts: Counter = Counter()
    conversations = normalise(
        tqdm(read_rows(dcfg, raw_counts), desc="read", unit=" rows", mininterval=2),
        dcfg,
        raw_counts,
    )
    counts.update(raw_counts)
    if not conversations:
        reasons = {k: v for k, v in raw_counts.items() if k.startswith("bad_")}
        raise Eagle3Error(
            f"data.source {dcfg.source}: no usable conversation in {raw_counts['rows']} rows "
            f"(rejected: {reasons or 'none'}); rows need messages, conversations or prompt"
        )
    conversations = apply_filters(conversations, dcfg.filters, counts)
    return split_conversations(conversations, dcfg, counts)
