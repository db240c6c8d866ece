"""What each stage's folder hash covers, by schema version: of the values a stage hashes (its
config sections and the values derived from them, gathered by eagle3.core.outputs), the keys left
out because they change how a stage runs, not what it writes, and the keys left out while they
hold the value they had before the key existed, so that outputs written before it keep their
hashes (and the shipped drafter, found by its hash, stays found).

A change that moves an existing hash is a new version: add it to SCHEMAS and make it CURRENT; never
edit a version outputs were hashed with (tests/unit/core/test_stage_hashes.py pins them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class Off:
    """Stands for every value that switches an option off: null, false, 0 and empty."""

    def __repr__(self) -> str:
        return "OFF"


OFF = Off()


@dataclass(frozen=True)
class Keys:
    """The keys of one hashed mapping: every key but `excluded`; a key of `absent_when` is left out
    while its value is one of those listed (OFF: any value that is off); a key of `only_with` is
    left out unless the sibling key it names holds one of the values listed; `nested`: the keys of
    a mapping held under a key."""

    excluded: tuple[str, ...] = ()
    absent_when: Mapping[str, tuple] = field(default_factory=dict)
    only_with: Mapping[str, tuple[str, tuple]] = field(default_factory=dict)
    nested: Mapping[str, Keys] = field(default_factory=dict)

    def select(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The hashed part of `values`."""
        kept = {}
        for key, value in values.items():
            if key in self.excluded or self._absent(key, value, values):
                continue
            kept[key] = self.nested[key].select(value) if key in self.nested else value
        return kept

    def _absent(self, key: str, value: Any, values: Mapping[str, Any]) -> bool:
        if key in self.absent_when and any(
            (not value) if listed is OFF else value == listed for listed in self.absent_when[key]
        ):
            return True
        if key in self.only_with:
            sibling, allowed = self.only_with[key]
            return values.get(sibling) not in allowed
        return False


# ------------------------------------------------------------ version 1

# data.regen: settings that change how fast regeneration runs (or what it reports), not what it
# produces (a rerun with another batch size or concurrency resumes the same output); keep_truncated
# chooses which answers a data output keeps (hashed by the data stage), not what they are
REGEN_V1 = Keys(
    excluded=(
        "batch_size",
        "concurrency",
        "timeout_s",
        "max_retries",
        "backoff_s",
        "api_key_env",
        "loop_ngram",
        "keep_truncated",
    ),
    absent_when={
        key: (None,) for key in ("reuse_answers", "seed", "reasoning", "reasoning_parser")
    },
    # the tags and the template switch count only where the reasoning mode reads them; the engine
    # and its precision (gathered as served_by) only where the engine writes the answers
    only_with={
        "think_tags": ("reasoning", ("keep", "drop")),
        "thinking_switch": ("reasoning", ("off",)),
        "served_by": ("backend", ("engine",)),
    },
)

# the conversations and their answers: the data config but the draft vocab's source (hashed by the
# data stage); the options that add prompts (eagle3.data.added_prompts) only when on
ANSWERS_V1 = Keys(
    nested={
        "data": Keys(
            excluded=("vocab_map_from",),
            absent_when={
                key: (OFF,) for key in ("first_turn_copies", "extra_sources", "self_prompts")
            },
            nested={"regen": REGEN_V1},
        )
    }
)

DATA_V1 = Keys(
    # a local source file's size and sha256 (none for packaged and hub sources); keep_truncated is
    # on only with data.regenerate
    absent_when={
        "source_fingerprint": (None,),
        "keep_truncated": (OFF,),
        "vocab_map_from": (None,),
    },
    nested=ANSWERS_V1.nested,
)

EXTRACT_V1 = Keys(
    nested={
        "extract": Keys(
            # how fast extraction runs, not what it writes
            excluded=(
                "batch_tokens",
                "verify",
                "disk_margin",
                "writers",
                "concurrency",
                "tensor_parallel_size",
                "pipeline_parallel_size",
                "engine",
            ),
            absent_when={"backend": ("hf",)},  # the HF extraction's hash predates the backends
        )
    }
)

TRAIN_V1 = Keys(
    nested={
        "drafter": Keys(excluded=("path",)),
        "train": Keys(
            # how training is watched or where it reads, not what it learns
            excluded=(
                "eval_prompts",
                "eval_max_new_tokens",
                "checkpoint_every_n_steps",
                "shards",
                "val_head_tokens",
                "compile_loss",
                "compile_unroll",
                "compile_target",
                "length_buckets",
                "adamw",
            ),
            absent_when={"init_from": (None,), "limit": (None,)},
        ),
    }
)

# where an export is registered and the checkpoint `python -m eagle3.export.checkpoint` reads
EXPORT_V1 = Keys(nested={"export": Keys(excluded=("register", "registry_name", "checkpoint"))})

SCHEMAS: dict[int, dict[str, Keys]] = {
    1: {
        "answers": ANSWERS_V1,  # the regenerated answers' log (eagle3.data.regen)
        "data": DATA_V1,
        "extract": EXTRACT_V1,
        "train": TRAIN_V1,
        "export": EXPORT_V1,
    }
}
CURRENT = 1


def hashed(stage: str, values: Mapping[str, Any], version: int = CURRENT) -> dict[str, Any]:
    """The part of a stage's gathered values its hash covers under schema `version`."""
    return SCHEMAS[version][stage].select(values)
