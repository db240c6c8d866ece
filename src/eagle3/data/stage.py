"""The data stage: prompts -> conversations -> token ids + loss masks -> vocab map.

Flow: read raw rows (ShareGPT package, local file, hub dataset) -> normalise each to
role/content messages (bad rows counted by reason, skipped) -> filters (counts before/after
each) -> seeded shuffle, limit, validation slice -> optional regeneration of the assistant
turns by the target (resumable) -> chat template + loss mask -> vocab map -> Arrow dataset.

The steps live in their own modules: sources (raw rows), conversations (normalising, filters,
splits), regen (regenerated answers), tokens (chat template, loss mask), vocab (the draft vocab
map); this module runs them in order and writes the stage's folder. `python -m eagle3.data`
(app.py) runs it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from eagle3.core.artifacts import StageOutput
from eagle3.core.common import Eagle3Error
from eagle3.core.config import Config, SuiteConfig
from eagle3.core.outputs import data_output
from eagle3.core.target import tokenizer_hash
from eagle3.core.tracking import stage_run
from eagle3.data.added_prompts import more_prompts, self_prompt_data
from eagle3.data.conversations import conversations_for
from eagle3.data.regen import (
    Regeneration,
    TurnLog,
    generator_for,
    regenerate,
    regeneration,
    sampling_params,
)
from eagle3.data.sources import local_source
from eagle3.data.tokens import load_tokenizer, tokenize_conversations
from eagle3.data.vocab import coverage_of, vocab_map_for

# ---------------------------------------------------------------- the stage


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


def run(cfg: Config) -> StageOutput:
    """Build the data stage's output (a no-op when it is complete)."""
    local_source(str(cfg.data.source))  # a missing file: refused before a run or a folder exists
    out = data_output(cfg)
    with out.lock():  # runs started at once (a parallel launcher): one builds, the others reuse
        if out.reusable(cfg.verify):
            return out
        with stage_run(cfg, "data", artifact_hash=out.hash) as mlflow_run:
            write_splits(
                regeneration(cfg), cfg.bench.suites, cfg.drafter.draft_vocab_size, out, mlflow_run
            )
    return out


def write_splits(
    regen: Regeneration,
    suites: dict[str, SuiteConfig],
    draft_vocab_size: int,
    out: StageOutput,
    mlflow_run,
) -> None:
    """Read, filter, regenerate and tokenise the conversations of regen.data into `out`, with the
    draft vocab map; `suites` are the bench suites (a data.extra_sources entry that is one is refused)."""
    out.start()
    started = time.time()
    counts: dict[str, Any] = {}
    data = regen.data
    splits = conversations_for(data, counts)
    splits = more_prompts(
        data,
        suites,
        splits,
        counts,
        regen.log_path.parent,
        lambda: generator_for(dataclasses.replace(regen, data=self_prompt_data(data))),
        TurnLog,
    )
    tokenizer, target_vocab = load_tokenizer(regen.target, regen.artifacts)
    if data.regenerate:
        splits = regenerate(regen, out.path, splits, tokenizer, counts)
    dropped: Counter = Counter()
    columns = {
        name: tokenize_conversations(tokenizer, convs, data, dropped)
        for name, convs in splits.items()
    }
    counts.update(dropped)
    train = columns["train"]
    if not train["id"]:
        raise Eagle3Error(
            f"data.source {data.source}: no training conversation has assistant tokens "
            f"after filtering and tokenisation (counts: {counts})"
        )
    # training validates every epoch (and datasets cannot reload an empty split)
    if not columns["val"]["id"]:
        raise Eagle3Error(
            f"data: the validation split is empty ({len(splits['val'])} held out by "
            f"data.val_fraction={data.val_fraction}, then dropped: {dict(dropped)}); raise "
            "data.val_fraction or data.limit"
        )
    d2t, t2d, coverage = vocab_map_for(draft_vocab_size, data.vocab_map_from, train, target_vocab)
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
    out.finish(counts, sampling=sampling_params(data))


def log_to_mlflow(counts: dict, train_ids: list[list[int]], out_dir: Path) -> None:
    import mlflow

    mlflow.log_metrics({k: float(v) for k, v in counts.items() if isinstance(v, (int, float))})
    mlflow.log_artifact(
        str(length_histogram([len(ids) for ids in train_ids], out_dir / "length_histogram.png"))
    )
