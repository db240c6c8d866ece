"""Stage folder hashes of composed configs, pinned: a change to what a stage's hash covers (or to
the defaults it drops) would move existing outputs and lose the shipped drafter, found by its hash."""

from __future__ import annotations

import pytest

from eagle3.core.common import compose
from eagle3.core.hash_schema import OFF, Keys
from eagle3.core.outputs import data_output, export_output, extract_output, train_output

# where the target runs decides the extract stage's compute dtype (auto: bfloat16 on a GPU)
ON_CPU = "target.device=cpu"

# config -> (data, extract, train, export) hashes
PINNED = {
    (): ("15cee8cfb094", "d4fdb9da066d", "7e75eb955da2", "ab2aa95ed39f"),
    # the shipped drafter's recipe (tests/integration/test_shipped.py): export 4f658d4f4df1
    (
        "experiment=smollm2-h200-turns3-sampled2",
        "paths.root=/tmp/e3",
        "data.source=/tmp/e3/turns3s2.jsonl",
    ): ("b0d987ab5650", "c038f96dfec8", "f61561dcab41", "4f658d4f4df1"),
    ("experiment=smollm2-h200-turns3",): (
        "40decabf35b7",
        "fb0808bf5b54",
        "e40e7601bf95",
        "96740aa72aa1",
    ),
    ("experiment=kimi-k2.5",): ("2014c169d0c9", "0a218fd1c31a", "7d9a7d0c4f26", "4092f213c3ae"),
    ("experiment=quickstart",): ("99cdf4cb6cbe", "e8aae6825c21", "be0827d94064", "b9c3a818c672"),
    (
        "data.regenerate=true",
        "data.regen.keep_truncated=true",
        "data.regen.reasoning=keep",
        "data.regen.seed=3",
        "data.vocab_map_from=/tmp/x",
        "data.first_turn_copies=2",
    ): ("ed2b9015e2fe", "53e99ddab291", "35d41975f9da", "24f69f4c441b"),
    ("data.regenerate=true", "data.regen.backend=engine", "data.regen.reasoning=off"): (
        "558079960da8",
        "b99acc0d98a1",
        "a8f39220f089",
        "5e2df9f3c552",
    ),
    (
        "extract.backend=vllm",
        "train.hidden_states=offline",
        "train.init_from=/tmp/y",
        "train.limit=10",
    ): ("15cee8cfb094", "85e6b6e69281", "addbbdb6c83e", "f868d4b64fc1"),
    ("train.hidden_states=engine",): (
        "15cee8cfb094",
        "d4fdb9da066d",
        "97492cc54160",
        "16cd6510aa38",
    ),
}


@pytest.mark.parametrize("overrides", list(PINNED), ids=lambda o: " ".join(o) or "default")
def test_stage_hashes_stay_as_pinned(overrides):
    cfg = compose([*overrides, ON_CPU])
    stages = (data_output, extract_output, train_output, export_output)
    assert tuple(stage(cfg).hash for stage in stages) == PINNED[overrides]


def test_a_local_source_files_content_is_in_the_data_hash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative source: the same path string on every run
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hello"}\n')
    cfg = compose(["data=file", "data.source=prompts.jsonl", "data.regenerate=true", ON_CPU])
    assert data_output(cfg).hash == "bbbbea78f4af"


def test_a_schema_leaves_out_excluded_keys_defaults_from_before_a_key_and_unread_keys():
    keys = Keys(
        excluded=("workers",),
        absent_when={"limit": (None,), "copies": (OFF,), "backend": ("hf",)},
        only_with={"tags": ("mode", ("keep",))},
        nested={"inner": Keys(excluded=("speed",))},
    )
    values = {
        "workers": 4,
        "limit": None,
        "copies": 0,
        "backend": "hf",
        "tags": "<t>",
        "mode": None,
    }
    assert keys.select({**values, "inner": {"speed": 1, "size": 2}}) == {
        "mode": None,
        "inner": {"size": 2},
    }
    values = {"limit": 5, "copies": [1], "backend": "vllm", "tags": "<t>", "mode": "keep"}
    assert keys.select(values) == values
    assert all(not keys.select({"copies": off}) for off in (0, [], None, False, {}))
