"""Data stage: sources, normalisation, filters, loss masks, vocab map, the stage's output."""

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from support import FIXTURES, REPO

from eagle3.core import outputs, target
from eagle3.core.common import Eagle3Error
from eagle3.core.drafter import build_drafter
from eagle3.core.drafter_io import export_sglang
from eagle3.data import regen, sources, tokens
from eagle3.data import stage as data
from eagle3.data.conversations import conversations_for, normalise, user_turns
from eagle3.data.prompt_files import write_prompts, write_suites
from eagle3.data.splits import load_splits
from eagle3.data.vocab import build_vocab_map, load_vocab_map

JSONL = FIXTURES / "conversations.jsonl"


def file_overrides(source=JSONL) -> list[str]:
    return [
        "target=tiny-llama",
        "data=file",
        f"data.source={source}",
        "data.val_fraction=0.2",
        "drafter.draft_vocab_size=256",
    ]


def file_cfg(make_cfg, *overrides, source=JSONL):
    return make_cfg(*file_overrides(source), *overrides)


def app_overrides(test_root, artifacts, *overrides) -> list[str]:
    """The data app's command line for the file fixture, into a private artifacts folder."""
    return [
        f"paths.root={test_root}",
        f"paths.artifacts={artifacts}",
        "tracking.enabled=false",
        *file_overrides(),
        *overrides,
    ]


def conversations(cfg):
    counts = Counter()
    return normalise(sources.read_rows(cfg.data, counts), cfg.data, counts), counts


def test_sharegpt_package_parses_complete_conversations(make_cfg):
    cfg = make_cfg()
    counts = Counter()
    rows = list(sources.read_rows(cfg.data, counts))
    assert len(rows) == 17671 and counts["truncated_tail"] == 1
    assert rows[0]["id"] == "QWJhYvA_0" and rows[0]["conversations"][0]["from"] == "human"


def test_bad_rows_are_counted_by_reason_and_skipped(make_cfg):
    convs, counts = conversations(file_cfg(make_cfg))
    bad = {k: v for k, v in counts.items() if k.startswith("bad_")}
    assert bad == {
        "bad_missing_role": 1,
        "bad_empty_content": 1,
        "bad_wrong_type": 2,
        "bad_roles_out_of_order": 1,
        "bad_unknown_role": 1,
        "bad_no_messages": 1,
        "bad_not_an_object": 1,
        "bad_no_turns": 1,
        "bad_invalid_utf8": 1,
        "bad_no_assistant_turn": 1,
    }
    assert counts["invalid_json"] == 1 and counts["rows"] == 22 and counts["normalised"] == 11
    ids = [c["id"] for c in convs]
    assert ids == [
        "m-1",
        "m-2",
        "s-1",
        "s-2",
        "m-3",
        "m-4",
        "m-5-dup",
        "m-6",
        "m-7-trailing-user",
        "m-8",
        "m-9",
    ]
    by_id = {c["id"]: c["messages"] for c in convs}
    # ShareGPT roles mapped, its leading assistant fragment dropped, a trailing unanswered user turn dropped
    assert by_id["s-2"] == [
        {"role": "user", "content": "Summarise it in one line."},
        {"role": "assistant", "content": "A fox outwits a crow to win some cheese."},
    ]
    assert [m["role"] for m in by_id["s-1"]] == ["user", "assistant"] * 3
    assert by_id["m-7-trailing-user"][-1] == {"role": "assistant", "content": "Eight."}


def test_json_array_and_parquet_sources_match_jsonl(make_cfg, tmp_path):
    from datasets import Dataset

    from_jsonl, _ = conversations(file_cfg(make_cfg))
    from_json, _ = conversations(file_cfg(make_cfg, source=FIXTURES / "conversations.json"))
    rows = json.loads((FIXTURES / "conversations.json").read_text())
    openai_rows = [
        r for r in rows if "messages" in r
    ]  # parquet needs one schema: the OpenAI-style rows
    Dataset.from_list(openai_rows).to_parquet(tmp_path / "rows.parquet")
    from_parquet, _ = conversations(file_cfg(make_cfg, source=tmp_path / "rows.parquet"))
    assert from_json == from_jsonl
    assert from_parquet == [c for c in from_jsonl if c["id"].startswith("m-")]


def test_missing_or_wrong_format_source_is_one_clear_error(make_cfg, tmp_path):
    for source, words in [
        (tmp_path / "nope.jsonl", "no such file"),
        (FIXTURES / "not_a_dataset.json", "not a JSON array or JSON lines"),
        (tmp_path / "prompts.csv", "no such file"),
    ]:
        with pytest.raises(Eagle3Error, match=words) as err:
            conversations(file_cfg(make_cfg, source=source))
        assert str(source) in str(err.value)
    (tmp_path / "prompts.csv").write_text("a,b\n")
    with pytest.raises(Eagle3Error, match="unsupported file type"):
        conversations(file_cfg(make_cfg, source=tmp_path / "prompts.csv"))
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(Eagle3Error, match="not a readable parquet"):
        conversations(file_cfg(make_cfg, source=tmp_path / "fake.parquet"))
    (tmp_path / "other.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    with pytest.raises(Eagle3Error, match="no usable conversation in 2 rows"):
        conversations_for(file_cfg(make_cfg, source=tmp_path / "other.jsonl").data, {})


def test_app_prints_one_line_error_for_missing_file(test_root, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3.data",
            f"paths.root={test_root}",
            "target=tiny-llama",
            "tracking.enabled=false",
            "data=file",
            f"data.source={tmp_path}/missing.jsonl",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith(f"eagle3 error: data.source {tmp_path}/missing.jsonl")
    )
    assert "Traceback" not in out.stderr


def test_filters_report_counts_before_and_after(make_cfg):
    cfg = file_cfg(
        make_cfg,
        "data.filters.min_turns=2",
        "data.filters.max_turns=2",
        "data.filters.max_chars=150",
    )
    counts: dict = {}
    splits = conversations_for(cfg.data, counts)
    assert (
        counts["normalised"],
        counts["after_min_turns"],
        counts["after_max_turns"],
        counts["after_max_chars"],
        counts["after_dedup_first_prompt"],
    ) == (11, 4, 3, 2, 2)
    assert sorted(c["id"] for s in splits.values() for c in s) == ["m-2", "m-3"]
    dedup = conversations_for(file_cfg(make_cfg).data, {})
    ids = [c["id"] for s in dedup.values() for c in s]
    assert "m-1" in ids and "m-5-dup" not in ids and len(ids) == 10


def test_split_is_seeded_limited_and_disjoint(make_cfg):
    a = conversations_for(file_cfg(make_cfg, "data.limit=8").data, {})
    b = conversations_for(file_cfg(make_cfg, "data.limit=8").data, {})
    c = conversations_for(file_cfg(make_cfg, "data.limit=8", "data.seed=1").data, {})
    assert a == b and a != c
    assert (len(a["train"]), len(a["val"])) == (6, 2)
    assert not {x["id"] for x in a["train"]} & {x["id"] for x in a["val"]}


def test_system_policy(make_cfg):
    replace, _ = conversations(
        file_cfg(
            make_cfg,
            "data.normalise.system_policy=replace",
            "data.normalise.system_prompt=Be brief.",
        )
    )
    drop, _ = conversations(file_cfg(make_cfg, "data.normalise.system_policy=drop"))
    assert all(c["messages"][0] == {"role": "system", "content": "Be brief."} for c in replace)
    assert sum(m["role"] == "system" for c in replace for m in c["messages"]) == len(replace)
    assert not any(m["role"] == "system" for c in drop for m in c["messages"])


MULTI_TURN = [
    {"role": "system", "content": "You answer tersely."},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "And an even one?"},
    {"role": "assistant", "content": "2 is the only even prime.\nNo other even number is."},
    {"role": "user", "content": "Write code."},
    {"role": "assistant", "content": "def f(n):\n    return n * 2  # 日本語"},
]


def masked_runs(tokenizer, ids, mask):
    """Decoded runs of consecutive masked tokens."""
    runs, current = [], []
    for token, bit in zip(ids + [None], mask + [0]):
        if bit:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


@pytest.mark.parametrize("system", [True, False])
def test_loss_mask_covers_exactly_assistant_contents_and_end_of_turn(make_cfg, tiny_target, system):
    cfg = file_cfg(make_cfg)
    tok = tiny_target.tokenizer
    messages = (
        MULTI_TURN if system else MULTI_TURN[1:]
    )  # without one, the template adds its default
    cols = tokens.tokenize_conversations(
        tok, [{"id": "x", "messages": messages}], cfg.data, Counter()
    )
    ids, mask = cols["input_ids"][0], cols["loss_mask"][0]
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert masked_runs(tok, ids, mask) == [a + "<|im_end|>" for a in answers]
    unmasked = tok.decode([t for t, bit in zip(ids, mask) if not bit])
    assert "You answer tersely." in unmasked or not system
    assert "Name a prime number." in unmasked and "<|im_start|>assistant\n" in unmasked


def test_loss_mask_follows_another_template(make_cfg, tiny_target):
    """No SmolLM2 offsets are hard-coded: a different layout and end-of-turn token work too."""
    tok = tiny_target.tokenizer
    saved = tok.chat_template
    tok.chat_template = (
        "{% for m in messages %}{{ '### ' + m['role'] + ':\n' + m['content'] + '<|endoftext|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '### assistant:\n' }}{% endif %}"
    )
    try:
        cfg = file_cfg(make_cfg, "data.end_of_turn='<|endoftext|>'")
        cols = tokens.tokenize_conversations(
            tok, [{"id": "x", "messages": MULTI_TURN}], cfg.data, Counter()
        )
    finally:
        tok.chat_template = saved
    answers = [m["content"] for m in MULTI_TURN if m["role"] == "assistant"]
    assert masked_runs(tok, cols["input_ids"][0], cols["loss_mask"][0]) == [
        a + "<|endoftext|>" for a in answers
    ]


def test_truncation_policies(make_cfg, tiny_target):
    tok = tiny_target.tokenizer
    conv = [{"id": "x", "messages": MULTI_TURN}]
    full = tokens.tokenize_conversations(tok, conv, file_cfg(make_cfg).data, Counter())[
        "input_ids"
    ][0]
    counts = Counter()
    cut = tokens.tokenize_conversations(
        tok, conv, file_cfg(make_cfg, "data.max_length=40").data, counts
    )
    assert cut["input_ids"][0] == full[:40] and counts["truncated"] == 1
    counts = Counter()
    dropped = tokens.tokenize_conversations(
        tok, conv, file_cfg(make_cfg, "data.max_length=40", "data.truncation=drop").data, counts
    )
    assert dropped["id"] == [] and counts["dropped_too_long"] == 1
    counts = Counter()  # cut before the first answer: nothing left to learn
    none = tokens.tokenize_conversations(
        tok, conv, file_cfg(make_cfg, "data.max_length=20").data, counts
    )
    assert none["id"] == [] and counts["dropped_no_assistant_tokens"] == 1


def test_vocab_map_matches_brute_force_counts():
    ids = [[5, 5, 5, 9, 2, 7], [7, 7, 3, 3, 3, 3, 1], [9, 9, 9, 9, 9]]
    masks = [[1, 1, 1, 1, 0, 1], [1, 1, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1]]
    counts = Counter(t for row, m in zip(ids, masks) for t, bit in zip(row, m) if bit)
    # counts: 9->5, 7->3, 3->3, 5->3, 1->1; ties go to the lower id
    d2t, t2d, coverage = build_vocab_map(ids, masks, target_vocab=12, draft_vocab=4)
    expected = sorted(sorted(counts, key=lambda t: (-counts[t], t))[:4])
    assert expected == [3, 5, 7, 9]
    assert d2t.dtype == torch.int64 and (torch.arange(4) + d2t).tolist() == expected
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == expected
    assert coverage == pytest.approx(14 / 15)
    # fewer distinct tokens than the draft vocab: unseen ids fill in, lowest first
    d2t, t2d, coverage = build_vocab_map(ids, masks, target_vocab=12, draft_vocab=7)
    assert (torch.arange(7) + d2t).tolist() == [0, 1, 2, 3, 5, 7, 9] and coverage == 1.0
    with pytest.raises(Eagle3Error, match="exceeds the target vocabulary"):
        build_vocab_map(ids, masks, target_vocab=12, draft_vocab=13)


def test_data_stage_output_manifest_mlflow_and_idempotence(make_cfg, tiny_target, own_artifacts):
    cfg = file_cfg(make_cfg, f"paths.artifacts={own_artifacts}")
    out = data.run(cfg)
    assert out.complete and out.path == outputs.data_output(cfg).path
    splits = load_splits(out.path)
    assert set(splits) == {"train", "val"} and splits["train"].column_names == [
        "id",
        "input_ids",
        "loss_mask",
    ]
    assert (len(splits["train"]), len(splits["val"])) == (8, 2)
    tok = tiny_target.tokenizer
    row = splits["train"][0]
    assert isinstance(row["id"], str) and len(row["input_ids"]) == len(row["loss_mask"])
    d2t, t2d = load_vocab_map(out.path)
    assert d2t.shape == (256,) and t2d.shape == (tiny_target.vocab_size,) and int(t2d.sum()) == 256
    counts = out.manifest()["counts"]
    assert counts["tokenizer_hash"] == target.tokenizer_hash(tok)
    assert counts["train_masked_tokens"] == sum(sum(r) for r in splits["train"]["loss_mask"])
    assert counts["coverage_train"] == 1.0  # 256 draft ids cover this tiny fixture's answer tokens
    assert counts["bad_invalid_utf8"] == 1 and counts["after_dedup_first_prompt"] == 10
    runs = MlflowClient(cfg.tracking.uri).search_runs(
        [
            MlflowClient(cfg.tracking.uri)
            .get_experiment_by_name(cfg.tracking.experiment)
            .experiment_id
        ]
    )
    metrics = runs[0].data.metrics
    assert metrics["bad_empty_content"] == 1 and metrics["train_conversations"] == 8
    artifacts = [a.path for a in MlflowClient(cfg.tracking.uri).list_artifacts(runs[0].info.run_id)]
    assert "length_histogram.png" in artifacts
    stamp = (out.path / "vocab_map.safetensors").stat().st_mtime_ns
    assert data.run(cfg).path == out.path
    assert (out.path / "vocab_map.safetensors").stat().st_mtime_ns == stamp  # second run is a no-op
    other = outputs.data_output(
        file_cfg(make_cfg, f"paths.artifacts={own_artifacts}", "drafter.draft_vocab_size=128")
    )
    assert other.hash != out.hash
    same = outputs.data_output(
        file_cfg(make_cfg, f"paths.artifacts={own_artifacts}", "data.regen.concurrency=3")
    )
    assert same.hash == out.hash  # execution-only settings do not change the output


def test_vocab_map_from_another_source(make_cfg, tiny_target, own_artifacts):
    """data.vocab_map_from: the draft vocab of another data output or of a drafter export (read by
    export.load_drafter, given the export's root) instead of this data's counts, with the coverage of
    this data's answers; a map of another size is refused naming the key; the regenerated answers' log
    is shared with the plain run."""
    plain = file_cfg(make_cfg, f"paths.artifacts={own_artifacts}", "drafter.draft_vocab_size=64")
    base = data.run(plain)
    own_d2t, own_t2d = load_vocab_map(base.path)
    d2t = torch.arange(0, 128, 2)[:64] - torch.arange(
        64
    )  # draft id i -> target id 2i: not the counted map
    t2d = torch.zeros(tiny_target.vocab_size, dtype=torch.bool)
    t2d[torch.arange(0, 128, 2)] = True
    assert not torch.equal(d2t, own_d2t)
    drafter = build_drafter(tiny_target, plain.drafter)
    drafter.set_vocab_map(d2t, t2d)
    export = export_sglang(drafter, own_artifacts / "export" / "sglang", {"ttt_length": 7})
    cfg = file_cfg(
        make_cfg,
        f"paths.artifacts={own_artifacts}",
        "drafter.draft_vocab_size=64",
        f"data.vocab_map_from={export.parent}",
    )
    out = data.run(cfg)
    assert (
        out.hash != base.hash
        and regen.regeneration(cfg).log_path == regen.regeneration(plain).log_path
    )
    got_d2t, got_t2d = load_vocab_map(out.path)
    assert torch.equal(got_d2t, d2t) and torch.equal(got_t2d, t2d)
    splits = load_splits(out.path)
    masked = torch.cat(
        [torch.tensor(r["input_ids"])[torch.tensor(r["loss_mask"]).bool()] for r in splits["train"]]
    )
    assert out.manifest()["counts"]["coverage_train"] == pytest.approx(
        float(t2d[masked].float().mean())
    )
    # another data output's map, given by its folder, is taken as it is
    again = data.run(
        file_cfg(
            make_cfg,
            f"paths.artifacts={own_artifacts}",
            "drafter.draft_vocab_size=64",
            "data.seed=1",
            f"data.vocab_map_from={base.path}",
        )
    )
    assert torch.equal(load_vocab_map(again.path)[0], own_d2t)
    with pytest.raises(Eagle3Error, match="data.vocab_map_from=.*64 draft ids.*needs 32"):
        data.run(
            file_cfg(
                make_cfg,
                f"paths.artifacts={own_artifacts}",
                "drafter.draft_vocab_size=32",
                f"data.vocab_map_from={export.parent}",
            )
        )


def test_empty_validation_split_is_one_clear_error(make_cfg, tiny_target, own_artifacts):
    """datasets cannot reload an empty split, and training validates every epoch: refused at the data stage."""
    cfg = file_cfg(make_cfg, f"paths.artifacts={own_artifacts}", "data.val_fraction=0")
    with pytest.raises(
        Eagle3Error, match=r"validation split is empty \(0 held out by data.val_fraction=0"
    ):
        data.run(cfg)
    assert not outputs.data_output(cfg).complete


def test_tokenizer_hash_tells_tokenizers_apart(tiny_target):
    tok = tiny_target.tokenizer
    before = target.tokenizer_hash(tok)
    saved = tok.chat_template
    tok.chat_template = "{{ messages }}"
    try:
        assert target.tokenizer_hash(tok) != before
    finally:
        tok.chat_template = saved
    assert target.tokenizer_hash(tok) == before


# ---------------------------------------------------------------- regeneration


def regen_cfg(make_cfg, artifacts, *overrides):
    return file_cfg(
        make_cfg,
        f"paths.artifacts={artifacts}",
        "data.regenerate=true",
        "data.regen.max_new_tokens=6",
        "data.regen.batch_size=4",
        "data.regen.keep_truncated=true",  # 6 tokens of a random target: every answer is cut
        *overrides,
    )


def greedy_answer(target, messages, max_new_tokens):
    """The target's own greedy answer to one prompt, unbatched: the reference."""
    tok = target.tokenizer
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = target.model.generate(
            **ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eot,
            pad_token_id=eot,
        )
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    new = new[: new.index(eot)] if eot in new else new
    return tok.decode(new, skip_special_tokens=True).strip()


def turn_records(out_path):
    lines = (out_path / "regen" / "turns.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def check_regenerated(out, target, source_convs, max_new_tokens=6):
    """Every user turn answered once, each answer the target's own greedy continuation of the
    conversation so far, and the dataset tokenizes exactly those conversations."""
    records = turn_records(out.path)
    keys = [(r["id"], r["turn"]) for r in records]
    assert len(keys) == len(set(keys))  # nothing duplicated
    answers = {(r["id"], r["turn"]): r["content"] for r in records}
    splits = load_splits(out.path)
    rows = {r["id"]: r for s in splits.values() for r in s}
    assert set(rows) == {c["id"] for c in source_convs}
    for conv in source_convs:
        users = [m["content"] for m in conv["messages"] if m["role"] == "user"]
        assert sorted(t for i, t in keys if i == conv["id"]) == list(range(len(users)))
        messages = [m for m in conv["messages"][:1] if m["role"] == "system"]
        for turn, user in enumerate(users):
            messages.append({"role": "user", "content": user})
            assert answers[(conv["id"], turn)] == greedy_answer(target, messages, max_new_tokens)
            messages.append({"role": "assistant", "content": answers[(conv["id"], turn)]})
        assert rows[conv["id"]]["input_ids"] == target.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=False
        )


def test_local_regeneration_answers_every_turn_with_the_targets_greedy_output(
    make_cfg, own_artifacts, tiny_target
):
    cfg = regen_cfg(make_cfg, own_artifacts)
    out = data.run(cfg)
    source = [c for s in conversations_for(cfg.data, {}).values() for c in s]
    assert any(c["id"] == "p-1" for c in source)  # a prompt-only row gets its answer
    check_regenerated(out, tiny_target, source)
    counts = out.manifest()[
        "counts"
    ]  # every answer is one of the 6-token greedy answers: none loops
    assert counts["regen_answers"] == sum(map(user_turns, source)) and counts["regen_looping"] == 0
    assert out.manifest()["sampling"] == {
        "backend": "local",
        "max_new_tokens": 6,
        "temperature": 0.0,
        "top_p": 1.0,
    }


def rewritten_prompts(text: bytes, suffix: str) -> bytes:
    """The JSONL fixture with `suffix` appended to every user turn (bad rows kept as they are)."""
    lines = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            lines.append(line)
            continue
        for m in row.get("messages") or [] if isinstance(row, dict) else []:
            if (
                isinstance(m, dict)
                and m.get("role") == "user"
                and isinstance(m.get("content"), str)
            ):
                m["content"] += suffix
        for m in row.get("conversations") or [] if isinstance(row, dict) else []:
            if isinstance(m, dict) and m.get("from") == "human" and isinstance(m.get("value"), str):
                m["value"] += suffix
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            row["prompt"] += suffix
        lines.append(json.dumps(row).encode())
    return b"\n".join(lines) + b"\n"


def test_rewritten_prompts_are_answered_anew_never_paired_with_old_answers(
    make_cfg, own_artifacts, tiny_target, tmp_path, monkeypatch
):
    """The answer log is keyed by the conversation up to each turn: after every prompt of the source
    is rewritten (ids and positions unchanged), no logged answer is taken and each answer is the
    target's greedy answer to the new prompt; with the old prompts back, every answer is found again
    and nothing is generated (generate swapped for a recorder)."""
    source = tmp_path / "conversations.jsonl"
    source.write_bytes(JSONL.read_bytes())
    overrides = (
        "data.regenerate=true",
        "data.regen.max_new_tokens=6",
        "data.regen.batch_size=4",
        "data.regen.keep_truncated=true",
    )
    cfg = file_cfg(make_cfg, f"paths.artifacts={own_artifacts}", *overrides, source=source)
    first = data.run(cfg)
    turns = first.manifest()["counts"]["regen_answers"]
    source.write_bytes(rewritten_prompts(JSONL.read_bytes(), " Answer in one line."))
    rewritten = data.run(cfg)
    assert rewritten.path != first.path
    assert rewritten.manifest()["counts"]["regen_turns_resumed"] == 0
    new_source = [c for s in conversations_for(cfg.data, {}).values() for c in s]
    assert any(" Answer in one line." in m["content"] for m in new_source[0]["messages"])
    check_regenerated(rewritten, tiny_target, new_source)
    generated = []
    monkeypatch.setattr(
        regen.LocalGenerator, "generate", lambda self, prompts: generated.append(prompts) or []
    )
    source.write_bytes(JSONL.read_bytes())
    shutil.rmtree(first.path)
    again = data.run(cfg)
    assert generated == [] and again.manifest()["counts"]["regen_turns_resumed"] == turns
    check_regenerated(
        again, tiny_target, [c for s in conversations_for(cfg.data, {}).values() for c in s]
    )


def test_another_draft_vocab_reuses_the_regenerated_answers(make_cfg, own_artifacts, monkeypatch):
    """The answers depend on the target and data config only: data outputs for other
    drafter.draft_vocab_size values take every answer from the shared log and generate nothing; without
    the shared log (a data output from before it, or copied in alone) a sibling output's copy seeds it.
    The generator's generate is swapped for a recorder: any call would be a regeneration."""
    first = data.run(regen_cfg(make_cfg, own_artifacts))
    turns = first.manifest()["counts"]["regen_answers"]
    generated = []
    monkeypatch.setattr(
        regen.LocalGenerator, "generate", lambda self, prompts: generated.append(prompts) or []
    )
    for vocab in (64, 32):
        cfg = regen_cfg(make_cfg, own_artifacts, f"drafter.draft_vocab_size={vocab}")
        out = data.run(cfg)
        assert out.path != first.path and out.complete and generated == []
        assert (
            out.manifest()["counts"]["regen_turns_resumed"] == turns == len(turn_records(out.path))
        )
        assert turn_records(out.path) == turn_records(first.path)
        assert load_vocab_map(out.path)[0].numel() == vocab
        shutil.rmtree(
            regen.regeneration(cfg).log_path.parent
        )  # the second round seeds from a data output's copy


def test_reuse_answers_takes_another_logs_answers_and_generates_the_rest(
    make_cfg, own_artifacts, tmp_path, monkeypatch
):
    """data.regen.reuse_answers: the answers other regenerations logged for these conversations' turns are
    taken (here their first turns, split over two logs that share one answer, the first ending in a line cut
    by a kill; a turn is taken once) and only the other turns are
    generated (the generator wrapped to count its prompts); greedy, they come out as the full run's. The
    setting is part of where the answers live (they need not be what these settings would generate)."""
    first = data.run(regen_cfg(make_cfg, own_artifacts))
    records = turn_records(first.path)
    first_turns = [r for r in records if r["turn"] == 0]
    assert 0 < len(first_turns) < len(records)  # the fixture has later turns to generate
    source, more = tmp_path / "turns.jsonl", tmp_path / "more.jsonl"  # a list of two logs
    half = len(first_turns) // 2
    source.write_text(
        "".join(json.dumps(r) + "\n" for r in first_turns[:half]) + '{"id": "cut", "tu'
    )
    more.write_text("".join(json.dumps(r) + "\n" for r in first_turns[half - 1 :]))
    generated, generate = [], regen.LocalGenerator.generate
    monkeypatch.setattr(
        regen.LocalGenerator,
        "generate",
        lambda self, prompts: generated.extend(prompts) or generate(self, prompts),
    )
    cfg = regen_cfg(make_cfg, own_artifacts, f"data.regen.reuse_answers=[{source},{more}]")
    assert (
        regen.regeneration(cfg).log_path
        != regen.regeneration(regen_cfg(make_cfg, own_artifacts)).log_path
    )
    out = data.run(cfg)
    counts = out.manifest()["counts"]
    assert counts["regen_turns_reused"] == len(first_turns) and len(generated) == len(
        records
    ) - len(first_turns)
    assert counts["regen_answers"] == len(records)
    answers = lambda rows: {(r["id"], r["turn"]): r["content"] for r in rows}  # noqa: E731
    assert answers(turn_records(out.path)) == answers(records)
    with pytest.raises(Eagle3Error, match="data.regen.reuse_answers=.*no such answer log"):
        data.run(
            regen_cfg(
                make_cfg, own_artifacts, f"data.regen.reuse_answers={tmp_path / 'missing.jsonl'}"
            )
        )


def test_regen_seed_draws_other_sampled_answers_and_stays_out_of_the_hash_when_null(
    make_cfg, own_artifacts
):
    """data.regen.seed: sampled answers are reproducible under one seed, differ under another, and null is
    data.seed (the same answers, and the answer log's old path: the key is left out of the hash)."""

    def sampled(seed):
        cfg = regen_cfg(
            make_cfg, own_artifacts, "data.regen.temperature=1.0", f"data.regen.seed={seed}"
        )
        out = data.run(cfg)
        return regen.regeneration(cfg).log_path, sorted(
            (r["id"], r["turn"], r["content"]) for r in turn_records(out.path)
        )

    default_path, default = sampled("null")
    data_seed = make_cfg().data.seed
    plain = regen_cfg(make_cfg, own_artifacts, "data.regen.temperature=1.0")
    assert (
        "seed"
        not in outputs.answer_sections(plain.data, plain.target, plain.serve)["data"]["regen"]
        and default_path == regen.regeneration(plain).log_path
    )
    same_path, same = sampled(data_seed)
    other_path, other = sampled(data_seed + 1)
    assert (
        same == default and same_path != default_path
    )  # the same draws, logged under the explicit key
    assert len({default_path, same_path, other_path}) == 3
    assert [key[:2] for key in other] == [key[:2] for key in default] and other != default
    shutil.rmtree(other_path.parent)
    for output in own_artifacts.glob("data/*/"):  # the folders, not their lock files
        shutil.rmtree(output)
    assert sampled(data_seed + 1)[1] == other  # regenerated from scratch: the same draws again


LOCK_HOLDER = """
import fcntl, os, pathlib, sys, time
folder, release = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
folder.mkdir(parents=True, exist_ok=True)
handle = open(folder / "lock", "a+")
fcntl.flock(handle, fcntl.LOCK_EX)
handle.truncate(0); handle.write(f"pid {os.getpid()}"); handle.flush()
print("holding", flush=True)
while not release.exists():
    time.sleep(0.05)
"""


def test_a_second_run_waits_for_the_one_regenerating(make_cfg, own_artifacts, caplog):
    """Two data runs with the same answers: the second waits on the shared log's lock, naming the
    holder, and regenerates only once it is free. The first run is played by a process that holds the
    real lock until told to let go, so the wait is seen without racing two regenerations."""
    import threading

    cfg = regen_cfg(make_cfg, own_artifacts)
    shared, release = regen.regeneration(cfg).log_path, own_artifacts / "release"
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(shared.parent), str(release)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "holding"
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=data.run(cfg)))

    def waiting() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if "is regenerating the answers" in r.getMessage()
        ]

    try:
        with caplog.at_level("INFO", logger="eagle3"):
            thread.start()
            deadline = time.time() + 300
            while not waiting() and thread.is_alive() and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)
            assert (
                thread.is_alive() and not shared.exists()
            )  # blocked before writing a single answer
            release.touch()
            thread.join(300)
    finally:
        release.touch()
    assert holder.wait(30) == 0
    assert waiting() == [
        f"data: another data run (pid {holder.pid}) is regenerating the answers in "
        f"{shared.parent}; waiting for it, then its answers are reused"
    ]
    source = [c for s in conversations_for(cfg.data, {}).values() for c in s]
    counts = result["out"].manifest()["counts"]
    assert counts["regen_turns_resumed"] == 0 and counts["regen_answers"] == sum(
        map(user_turns, source)
    )
    assert (shared.parent / "lock").read_text() == f"pid {os.getpid()}"  # the last holder: this run


class ChatServer:
    """A small real OpenAI-compatible server on 127.0.0.1 serving the tiny target's greedy answers.
    Failures are simulated on purpose: `always_fail` prompts get HTTP 500, `fail_once` prompts get
    one 500 or one slow (past the client's timeout) response before they succeed."""

    def __init__(self, target, api_key):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.target, self.api_key = target, api_key
        self.always_fail: set[str] = set()
        self.fail_once: dict[str, str] = {}
        self.requests: list[str] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, body):
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                self.reply(
                    200, {"object": "list", "data": [{"id": "tiny-llama", "object": "model"}]}
                )

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.headers.get("Authorization") != f"Bearer {server.api_key}":
                    return self.reply(401, {"error": "bad key"})
                status, answer = server.answer(body)
                if status != 200:
                    return self.reply(status, {"error": "simulated failure"})
                self.reply(
                    200,
                    {
                        "object": "chat.completion",
                        "model": body["model"],
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "length",
                                "message": {"role": "assistant", "content": answer},
                            }
                        ],
                    },
                )

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def answer(self, body):
        first_user = next(m["content"] for m in body["messages"] if m["role"] == "user")
        with self.lock:
            self.requests.append(first_user)
            if first_user in self.always_fail:
                return 500, None
            fault = self.fail_once.pop(first_user, None)
        if fault == "error":
            return 503, None
        if fault == "slow":
            time.sleep(1.5)
        with self.lock:
            return 200, greedy_answer(self.target, body["messages"], body["max_tokens"])

    def close(self):
        self.http.shutdown()
        self.http.server_close()


def test_openai_regeneration_retries_reports_failures_and_resumes(
    make_cfg, own_artifacts, tiny_target, monkeypatch
):
    key = "sk-test-0123456789-do-not-log"
    monkeypatch.setenv("EAGLE3_TEST_KEY", key)
    server = ChatServer(tiny_target, key)
    try:
        server.always_fail = {"Say hi."}
        server.fail_once = {"Is 91 prime?": "slow", "List three colours.": "error"}
        cfg = regen_cfg(
            make_cfg,
            own_artifacts,
            "data.regen.backend=openai",
            f"data.regen.base_url={server.url}",
            "data.regen.api_key_env=EAGLE3_TEST_KEY",
            "data.regen.max_retries=2",
            "data.regen.backoff_s=0.05",
            "data.regen.timeout_s=1",
            "data.regen.concurrency=3",
        )
        with pytest.raises(Eagle3Error, match="1 conversations failed regeneration") as err:
            data.run(cfg)
        out = outputs.data_output(cfg)
        failed = json.loads((out.path / "regen" / "failed.json").read_text())
        assert (
            list(failed) == ["m-9"]
            and "HTTP 500" in failed["m-9"]
            and str(out.path) in str(err.value)
        )
        assert server.requests.count("Say hi.") == 3  # first try + 2 retries
        assert (
            server.requests.count("Is 91 prime?") == 2
            and server.requests.count("List three colours.") == 2
        )
        done = {(r["id"], r["turn"]) for r in turn_records(out.path)}
        assert ("m-8", 0) in done and ("m-4", 0) in done and not any(i == "m-9" for i, _ in done)
        # the endpoint recovers: a rerun asks only for what is missing
        server.always_fail, server.requests = set(), []
        out = data.run(cfg)
        assert out.complete and server.requests == ["Say hi."]
        assert not (out.path / "regen" / "failed.json").exists()
        source = [c for s in conversations_for(cfg.data, {}).values() for c in s]
        check_regenerated(out, tiny_target, source)
        assert out.manifest()["sampling"]["base_url"] == server.url
        for path in out.path.rglob("*"):  # the key is never written anywhere
            if path.is_file():
                assert key.encode() not in path.read_bytes()
    finally:
        server.close()


def test_openai_endpoint_down_is_one_clear_error(make_cfg, own_artifacts):
    cfg = regen_cfg(
        make_cfg,
        own_artifacts,
        "data.regen.backend=openai",
        "data.regen.base_url=http://127.0.0.1:9/v1",
    )
    with pytest.raises(Eagle3Error, match="cannot list models at http://127.0.0.1:9/v1/models"):
        data.run(cfg)


def app_command(stage, cfg_overrides):
    return [sys.executable, "-m", f"eagle3.{stage}", *cfg_overrides]


def kill_when(proc, ready, timeout=600):
    """SIGKILL the process as soon as ready() holds; fail if it finished first."""
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, "the run finished before it could be interrupted"
        assert time.time() < deadline
        time.sleep(0.05)
    proc.kill()  # SIGKILL: no cleanup code runs
    proc.wait()


def test_kill_9_during_regeneration_resumes_without_loss_or_duplicates(
    make_cfg, own_artifacts, tiny_target, test_root, tmp_path
):
    overrides = app_overrides(
        test_root,
        own_artifacts,
        "data.regenerate=true",
        "data.regen.max_new_tokens=16",
        "data.regen.batch_size=1",
        "data.regen.keep_truncated=true",  # every turn answered: 17 lines in the log
    )
    cfg = make_cfg(*overrides[1:])
    out = outputs.data_output(cfg)
    turns_file = regen.regeneration(cfg).log_path
    proc = subprocess.Popen(
        app_command("data", overrides), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    kill_when(proc, lambda: turns_file.exists() and turns_file.read_bytes().count(b"\n") >= 3)
    written = turns_file.read_bytes().count(b"\n")
    assert not out.complete and written < 17  # 17 user turns in all: the kill cut the run short
    out = data.run(cfg)
    assert out.complete and out.manifest()["counts"]["regen_turns_resumed"] >= 3
    source = [c for s in conversations_for(cfg.data, {}).values() for c in s]
    check_regenerated(out, tiny_target, source, max_new_tokens=16)
    assert len(turn_records(out.path)) == 17


def test_loop_start_finds_where_an_ngram_comes_round_the_third_time():
    cycle = "the sky is blue and the sea is green "
    looping = "I like it. " + cycle * 3
    assert regen.loop_start(looping, 8) == len("I like it. ") + 2 * len(cycle)
    assert regen.loop_start("I like it. " + cycle * 2, 8) is None  # twice is not a loop yet
    assert regen.loop_start(cycle * 3, 9) == 2 * len(
        cycle
    )  # the cycle is 9 words: its first 9-gram fits 3 times
    assert regen.loop_start(cycle * 3, 10) is None  # a 10-gram would need 28 words
    assert regen.loop_start("short", 8) is None


def test_report_loops_counts_every_answer_of_every_split():
    cycle = "one two three four five six seven eight "

    def conv(*answers):
        messages = []
        for a in answers:
            messages += [{"role": "user", "content": "q"}, {"role": "assistant", "content": a}]
        return {"id": "x", "messages": messages}

    counts = {}
    regen.report_loops(
        {"train": [conv(cycle * 4, "fine"), conv("fine")], "val": [conv(cycle * 3)]}, 8, counts
    )
    assert (counts["regen_answers"], counts["regen_looping"]) == (4, 2)


def test_prompt_file_keeps_the_first_user_turns(tmp_path):
    """write_prompts(all_turns, max_turns=2) (python -m eagle3.data.prompt_files --all-turns --max-turns 2): each conversation of the shipped slice
    up to (not including) its third user turn, every assistant answer a '.' placeholder."""
    from eagle3.core.common import compose

    out = tmp_path / "turns2.jsonl"
    assert write_prompts(out, limit=300, max_chars=2000, all_turns=True, max_turns=2) == 300
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    conversations = conversations_for(
        compose(["data=sharegpt", "data.val_fraction=0"]).data, Counter()
    )["train"]
    source = {c["id"]: c["messages"] for c in conversations}
    assert len(rows) == 300
    for row in rows:
        messages = source[row["id"]]
        third = [i for i, m in enumerate(messages) if m["role"] == "user"][2:3]
        expected = messages[: third[0]] if third else messages
        assert [m["role"] for m in row["messages"]] == [m["role"] for m in expected]
        assert [m["content"] for m in row["messages"]] == [
            m["content"] if m["role"] != "assistant" else "." for m in expected
        ]
    assert sum(len([m for m in r["messages"] if m["role"] == "user"]) == 2 for r in rows) > 100


def test_prompt_file_with_first_turn_copies(tmp_path):
    """--first-turn-copies 2: after each conversation (its first three user turns) two rows <id>~1, <id>~2
    holding its first user turn alone, the same messages up to and including that turn's placeholder."""
    out = tmp_path / "turns3s.jsonl"
    write_prompts(out, 40, 2000, all_turns=True, max_turns=3, first_turn_copies=2)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 120
    for original, *copies in zip(rows[0::3], rows[1::3], rows[2::3]):
        assert [c["id"] for c in copies] == [f"{original['id']}~1", f"{original['id']}~2"]
        first_user = next(i for i, m in enumerate(original["messages"]) if m["role"] == "user")
        expected = original["messages"][: first_user + 2]  # up to the first answer's placeholder
        assert all(c["messages"] == expected for c in copies)
        assert sum(m["role"] == "user" for m in copies[0]["messages"]) == 1
    assert sum(sum(m["role"] == "user" for m in r["messages"]) > 1 for r in rows[0::3]) > 10


def test_suite_files_hold_every_prompt_of_the_shipped_suites(tmp_path):
    """write_suites (python -m eagle3.data.prompt_files --suites): one suite_<name>.jsonl per configured suite, every prompt
    in the suite's order with the messages the bench stage would send."""
    from eagle3.core.common import compose
    from eagle3.data.suites import load_suite

    written = write_suites(tmp_path)
    suites = (
        ("vicuna", 80),
        ("humaneval", 164),
        ("gsm8k", 100),
        ("koala", 156),
        ("arena-hard", 750),
    )
    assert {path.name: n for path, n in written.items()} == {
        f"suite_{name}.jsonl": count for name, count in suites
    }
    for name, count in suites:
        rows = [
            json.loads(line) for line in (tmp_path / f"suite_{name}.jsonl").read_text().splitlines()
        ]
        prompts = load_suite(compose([f"bench.suite={name}", "bench.limit=null"]).bench)
        assert len(rows) == len(prompts) == count
        assert [(r["id"], r["messages"]) for r in rows] == [(p.id, p.messages) for p in prompts]


SHIPPED_ANSWERS = {  # assets/regen-<hash>.tgz: (experiments, their prompt file, answered turns, turn numbers)
    "07ac172fdd52": (
        ("smollm2-h200-turns3", "smollm2-h200-turns3-v32k", "smollm2-h200-turns3-v32k-more"),
        "turns3.jsonl",
        33189,
        {0, 1, 2},
    ),
    "22ea300a3a13": (("smollm2-h200-turns3-sampled",), "turns3s.jsonl", 33189 + 14066, {0, 1, 2}),
    # only the answers it generated: the data stage reuses the rest from 22ea300a3a13 (data.regen.reuse_answers)
    "fea6c3211aa9": (
        ("smollm2-h200-turns3-sampled2",),
        "turns3s2.jsonl",
        14066,
        {0},
    ),
}


def shipped_answers(answer_hash: str) -> tuple[str, list[dict]]:
    import tarfile

    asset = REPO / "assets" / f"regen-{answer_hash}.tgz"
    with tarfile.open(asset) as archive:
        (member,) = archive.getnames()
        return member, [
            json.loads(line) for line in archive.extractfile(member).read().decode().splitlines()
        ]


def test_every_shipped_answer_file_is_listed_here():
    folder = REPO / "assets"
    assert sorted(p.name for p in folder.glob("regen-*.tgz")) == sorted(
        f"regen-{h}.tgz" for h in SHIPPED_ANSWERS
    )


@pytest.mark.parametrize("answer_hash", sorted(SHIPPED_ANSWERS))
def test_shipped_answers_are_the_ones_their_experiments_ask_for(answer_hash):
    """assets/regen-<hash>.tgz: the hash is the regen log path that its experiments compute
    for the H200 run's prompt file, and every answered turn belongs to a conversation of the
    shipped slice or to a first-turn copy of one (<id>~n): a config change that moves the hash makes
    this fail, and a GPU run would silently regenerate again."""
    from eagle3.core.common import compose

    experiments, prompt_file, count, turns = SHIPPED_ANSWERS[answer_hash]
    member, rows = shipped_answers(answer_hash)
    for experiment in experiments:
        cfg = compose(
            [f"experiment={experiment}", "paths.root=/tmp/e3", f"data.source=/tmp/e3/{prompt_file}"]
        )
        assert (
            regen.regeneration(cfg).log_path.relative_to(cfg.paths.artifacts).as_posix() == member
        )
    assert member.split("/")[1] == answer_hash and len(rows) == count
    ids = {
        c["id"]
        for c in conversations_for(
            compose(["data=sharegpt", "data.val_fraction=0"]).data, Counter()
        )["train"]
    }
    copies = {r["id"] for r in rows if "~" in r["id"]}
    assert {r["id"] for r in rows} - copies <= ids and {i.split("~")[0] for i in copies} <= ids
    assert {r["turn"] for r in rows if "~" in r["id"]} <= {0} and {r["turn"] for r in rows} == turns


def test_the_scratch_recipe_finds_every_answer_it_needs_in_the_shipped_logs(tmp_path):
    """experiment=smollm2-h200-scratch reuses two shipped logs (data.regen.reuse_answers, unpacked under the
    artifacts folder): every turn of its prompt file is answered there, found by its key (the conversation
    so far), so its data stage generates nothing."""
    from eagle3.core.common import compose
    from eagle3.data.prompt_files import write_prompts

    prompt_file = tmp_path / "turns1s2.jsonl"
    assert write_prompts(prompt_file, 100000, 2000, True, 1, 2) == 14066
    cfg = compose(
        ["experiment=smollm2-h200-scratch", "paths.root=/tmp/e3", f"data.source={prompt_file}"]
    )
    logs = [
        Path(str(p)).relative_to(cfg.paths.artifacts).as_posix()
        for p in cfg.data.regen.reuse_answers
    ]
    answered = {}
    for answer_hash in ("22ea300a3a13", "fea6c3211aa9"):
        member, rows = shipped_answers(answer_hash)
        assert member in logs
        answered.update({r["key"]: r["content"] for r in rows})
    rows = [json.loads(line) for line in prompt_file.read_text().splitlines()]
    assert len(rows) == 3 * 14066
    assert all(sum(m["role"] == "user" for m in r["messages"]) == 1 for r in rows)
    convs = [c for split in conversations_for(cfg.data, Counter()).values() for c in split]
    assert len(convs) == len(rows)
    assert all(len(regen.conversation_answers(c, answered)) == 1 for c in convs)


def test_sampled_answers_reuse_the_greedy_ones_word_for_word():
    """The sampled experiment's log holds the greedy log's answers unchanged (data.regen.reuse_answers)."""
    _, greedy = shipped_answers("07ac172fdd52")
    _, sampled = shipped_answers("22ea300a3a13")

    def by_turn(rows):
        return sorted((r["id"], r["turn"], r["content"]) for r in rows)

    assert by_turn(r for r in sampled if "~" not in r["id"]) == by_turn(greedy)


def test_second_sampled_answers_are_one_new_copy_of_each_first_turn_the_sampled_log_has():
    """regen-fea6c3211aa9 ships what experiment=smollm2-h200-turns3-sampled2 generated: an <id>~2 answer for
    each <id>~1 of the sampled log and nothing that log already answers, so the two together are its whole log."""
    _, sampled = shipped_answers("22ea300a3a13")
    _, second = shipped_answers("fea6c3211aa9")
    first_copies = sorted(r["id"].split("~")[0] for r in sampled if r["id"].endswith("~1"))
    assert sorted(r["id"].split("~")[0] for r in second if r["id"].endswith("~2")) == first_copies
    assert len(second) == len(first_copies) == 14066
    assert (
        sum(r["content"] is None for r in second) == 10
    )  # first turns longer than data.max_length


def test_a_missing_data_source_leaves_no_run_and_no_output_folder(
    make_cfg, own_artifacts, tmp_path
):
    missing = tmp_path / "gone.jsonl"
    cfg = file_cfg(make_cfg, f"paths.artifacts={own_artifacts}", source=missing)
    with pytest.raises(Eagle3Error) as err:
        data.run(cfg)
    assert str(err.value) == f"data.source {missing}: no such file"
    assert not (own_artifacts / "data").exists()
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert client.search_runs(experiments) == []


def test_two_data_stages_started_at_once_build_one_folder(test_root, own_artifacts):
    procs = [
        subprocess.Popen(
            app_command("data", app_overrides(test_root, own_artifacts)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    logs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], logs
    # the second waits on the folder's lock, then finds the first one's output complete
    assert sum("is complete, nothing to do" in log for log in logs) == 1, logs
    folders = [p for p in (own_artifacts / "data").iterdir() if p.is_dir()]
    assert len(folders) == 1 and json.loads((folders[0] / "manifest.json").read_text())["complete"]


def test_reuse_answers_of_another_target_is_refused_naming_both_targets(make_cfg, own_artifacts):
    """Answers tiny-llama (seed 0) wrote, in the shared log (answers.json beside it) and in the data
    output's copy (its manifest above it), offered to a tiny-llama of seed 1: refused, naming both
    targets, before anything is generated or taken."""
    first_cfg = regen_cfg(make_cfg, own_artifacts, "data.limit=3")
    first = data.run(first_cfg)
    for source in (regen.regeneration(first_cfg).log_path, first.path / "regen" / "turns.jsonl"):
        cfg = regen_cfg(
            make_cfg,
            own_artifacts,
            "data.limit=3",
            "target.seed=1",
            f"data.regen.reuse_answers={source}",
        )
        with pytest.raises(Eagle3Error) as refused:
            data.run(cfg)
        assert str(refused.value) == (
            f"data.regen.reuse_answers={source}: its answers were written by target tiny-llama "
            "(seed 0), this config's target is tiny-llama (seed 1); another target's answers are "
            "not this one's: leave that log out"
        )
        log = regen.regeneration(cfg).log_path  # nothing taken into this target's log
        assert not log.exists() or log.read_text() == ""
