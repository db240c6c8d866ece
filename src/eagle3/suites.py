"""Bench prompt suites: files shipped inside installed packages (described in conf/bench) or a
user JSONL with a `prompt` or `messages` field. A prompt is a list of chat messages."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from eagle3.common import Eagle3Error, installed_file


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
        return Prompt(row_id, [dict(m) for m in messages])
    if not isinstance(row.get(field), str):
        raise Eagle3Error(f"{source} row {index}: no string field `{field}` (or `messages`)")
    return Prompt(row_id, [{"role": "user", "content": row[field]}])


def suite_rows(bcfg: DictConfig) -> tuple[list[dict], str, str]:
    """(rows, text field, source description) for bench.prompts or the named bench.suite."""
    if bcfg.prompts:
        path = Path(str(bcfg.prompts)).expanduser()
        if not path.exists():
            raise Eagle3Error(
                f"bench.prompts={path} does not exist (a JSONL with `prompt` or `messages`)"
            )
        return read_rows(path), "prompt", str(path)
    if bcfg.suite not in bcfg.suites:
        raise Eagle3Error(
            f"unknown bench.suite {bcfg.suite!r}: use one of {', '.join(bcfg.suites)} "
            "or bench.prompts=<file.jsonl>"
        )
    suite = bcfg.suites[bcfg.suite]
    rows = read_rows(packaged_file(suite.package, suite.file))
    rows = [r for r in rows if all(r.get(k) == v for k, v in (suite.get("where") or {}).items())]
    return rows, suite.field, f"{bcfg.suite} ({suite.package})"


def load_suite(bcfg: DictConfig) -> list[Prompt]:
    """The prompts of the configured suite, the first bench.limit of them when set."""
    rows, field, source = suite_rows(bcfg)
    prompts = [to_prompt(row, i, field, source) for i, row in enumerate(rows)]
    if not prompts:
        raise Eagle3Error(f"prompt suite {source} is empty")
    return prompts[: bcfg.limit] if bcfg.limit is not None else prompts


def check_bench_settings(bcfg: DictConfig) -> None:
    """bench.* values that cannot be measured, refused before anything is launched."""
    for key, least in (("batch_size", 1), ("max_new_tokens", 1), ("warmup", 0)):
        value = bcfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise Eagle3Error(f"bench.{key}={value}: must be an integer >= {least}")
    limit = bcfg.get("limit")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise Eagle3Error(
            f"bench.limit={limit}: must be a number of prompts >= 1, or null for all of them"
        )


def suite_name(bcfg: DictConfig) -> str:
    return Path(str(bcfg.prompts)).stem if bcfg.prompts else bcfg.suite
