"""Bench prompt suites: files shipped inside installed packages (described in conf/bench) or a
user JSONL with a `prompt` or `messages` field. A prompt is a list of chat messages."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import ListConfig

from eagle3.core.common import Eagle3Error, installed_file
from eagle3.core.config import BenchConfig


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict]


def read_rows(path: Path) -> list[dict]:
    """Rows of a .json (a list), .jsonl or .jsonl.gz file; a malformed one is one line naming
    the file and the line (a UTF-8 byte order mark is skipped)."""
    if path.is_dir():
        raise Eagle3Error(f"{path} is a directory: give a .jsonl or .json file of prompts")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8-sig") as handle:
            if path.name.endswith((".jsonl", ".jsonl.gz")):
                return [
                    json_line(line, path, number)
                    for number, line in enumerate(handle, 1)
                    if line.strip()
                ]
            rows = json.load(handle)
    except json.JSONDecodeError as err:
        raise Eagle3Error(
            f"{path} is not JSON (line {err.lineno}, column {err.colno}: {err.msg})"
        ) from None
    except (UnicodeDecodeError, OSError) as err:
        raise Eagle3Error(f"{path} cannot be read as UTF-8 JSON: {err}") from None
    if not isinstance(rows, list):
        raise Eagle3Error(f"{path}: expected a JSON list of rows")
    return rows


def json_line(line: str, path: Path, number: int):
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise Eagle3Error(f"{path} line {number} is not JSON ({err.msg})") from None


def packaged_file(package: str, relative: str) -> Path:
    """A suite's data file inside an installed distribution, located without importing it."""
    return installed_file(package, relative)


def to_prompt(row: dict, index: int, field: str, source: str) -> Prompt:
    if not isinstance(row, dict):
        raise Eagle3Error(f"{source} row {index}: expected a JSON object, got {type(row).__name__}")
    row_id = str(row.get("id", row.get("task_id", row.get("question_id", index))))
    if "messages" in row and field == "prompt":
        messages = row["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "content" in m for m in messages
        ):
            raise Eagle3Error(
                f"{source} row {index}: `messages` must be a list of {{role, content}} dicts"
            )
        return checked_text(Prompt(row_id, [dict(m) for m in messages]), index, source)
    if not isinstance(row.get(field), str):
        raise Eagle3Error(f"{source} row {index}: no string field `{field}` (or `messages`)")
    return checked_text(Prompt(row_id, [{"role": "user", "content": row[field]}]), index, source)


def checked_text(prompt: Prompt, index: int, source: str) -> Prompt:
    """A prompt whose text a tokenizer can encode: JSON can escape half of a UTF-16 surrogate pair
    ("\\ud800"), which is no Unicode character (the tokenizer fails on it); refused naming the row."""
    for message in prompt.messages:
        text = message.get("content")
        if not isinstance(text, str):
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise Eagle3Error(
                f"{source} row {index}: a lone surrogate {text[err.start]!r} at character "
                f"{err.start} is not valid Unicode (write both halves of a surrogate pair, or the "
                "character itself)"
            ) from None
    return prompt


def suite_names(bcfg: BenchConfig) -> list[str]:
    """bench.suite as a list: one name, or several (`bench.suite=[vicuna,humaneval,gsm8k]`)."""
    suite = bcfg.suite
    return [str(name) for name in suite] if isinstance(suite, (list, ListConfig)) else [str(suite)]


def named_suite_rows(bcfg: BenchConfig, name: str) -> tuple[list[dict], str, str]:
    """(rows, text field, source description) of one configured suite."""
    if name not in bcfg.suites:
        raise Eagle3Error(
            f"unknown bench.suite {name!r}: use one of {', '.join(bcfg.suites)} "
            "or bench.prompts=<file.jsonl>"
        )
    suite = bcfg.suites[name]
    rows = read_rows(packaged_file(suite.package, suite.file))
    rows = [r for r in rows if all(r.get(k) == v for k, v in (suite.where or {}).items())]
    return rows, suite.field, f"{name} ({suite.package})"


def prompts_of(rows: list[dict], field: str, source: str, limit: int | None) -> list[Prompt]:
    prompts = [to_prompt(row, i, field, source) for i, row in enumerate(rows)]
    if not prompts:
        raise Eagle3Error(f"prompt suite {source} is empty")
    return prompts[:limit] if limit is not None else prompts


def load_suite(bcfg: BenchConfig) -> list[Prompt]:
    """The prompts of bench.prompts, or of each bench.suite in order: the first bench.limit of
    each (a job over several suites sums them: tok/s is all tokens over all wall time)."""
    if bcfg.prompts:
        path = Path(str(bcfg.prompts)).expanduser()
        if not path.exists():
            raise Eagle3Error(
                f"bench.prompts={path} does not exist (a JSONL with `prompt` or `messages`)"
            )
        return prompts_of(read_rows(path), "prompt", str(path), bcfg.limit)
    return [
        prompt
        for name in suite_names(bcfg)
        for prompt in prompts_of(*named_suite_rows(bcfg, name), bcfg.limit)
    ]


def check_bench_settings(bcfg: BenchConfig) -> None:
    """bench.* values that cannot be measured, refused before anything is launched."""
    for key, least in (("batch_size", 1), ("max_new_tokens", 1), ("warmup", 0), ("repeats", 1)):
        value = getattr(bcfg, key)
        if key == "warmup" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise Eagle3Error(f"bench.{key}={value}: must be an integer >= {least}")
    limit = bcfg.limit
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise Eagle3Error(
            f"bench.limit={limit}: must be a number of prompts >= 1, or null for all of them"
        )


def suite_name(bcfg: BenchConfig) -> str:
    return Path(str(bcfg.prompts)).stem if bcfg.prompts else "+".join(suite_names(bcfg))
