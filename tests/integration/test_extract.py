"""Extraction: packed shards equal a direct forward, resume at shard granularity, verification."""

import json
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from support import FIXTURES

from eagle3.core import outputs
from eagle3.core.common import Eagle3Error
from eagle3.data import stage as data
from eagle3.data.splits import load_splits
from eagle3.extract import stage as extract
from eagle3.extract.shards import ShardDataset


def tiny_cfg(make_cfg, artifacts, *overrides):
    return make_cfg(
        "target=tiny-llama",
        "data=file",
        f"data.source={FIXTURES / 'conversations.jsonl'}",
        "data.val_fraction=0.2",
        "drafter.draft_vocab_size=256",
        f"paths.artifacts={artifacts}",
        "extract.shard_tokens=200",
        "extract.batch_tokens=250",
        *overrides,
    )


def reference_states(target, ids: list[int]):
    """The target's own hidden_states for one unpadded sequence, at the aux ids in order."""
    with torch.no_grad():
        hs = target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in target.aux_layer_ids], dim=-1)[0], hs[-1][0]


def assert_bf16_equal(stored: torch.Tensor, reference: torch.Tensor):
    """Stored bf16 states equal the float32 reference rounded to bf16 (a batched matmul may land a
    handful of values one bf16 step away)."""
    expected = reference.to(torch.bfloat16)
    assert stored.dtype == torch.bfloat16 and stored.shape == expected.shape
    torch.testing.assert_close(stored.float(), expected.float(), rtol=2**-7, atol=1e-3)
    assert (stored == expected).float().mean() > 0.99  # a wrong layer or order matches ~0%


def test_length_batches_and_shard_plan():
    lengths = [5, 100, 7, 30, 30, 2, 64, 64, 1]
    batches = extract.length_batches(lengths, batch_tokens=64)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 64 or len(b) == 1 for b in batches)
    assert [100] in [[lengths[i] for i in b] for b in batches]  # too long for any batch: alone
    rows = {
        "id": [f"c{i}" for i in range(len(lengths))],
        "input_ids": [[1] * n for n in lengths],
        "loss_mask": [[1] * n for n in lengths],
    }
    plans = extract.plan_shards("train", rows, shard_tokens=100)
    assert [p.ids for p in plans] == [
        ["c0"],
        ["c1"],
        ["c2", "c3", "c4", "c5"],
        ["c6"],
        ["c7", "c8"],
    ]
    assert [p.first_row for p in plans] == [0, 1, 2, 6, 7]
    assert [p.file for p in plans][:2] == [
        "train/shard-00000.safetensors",
        "train/shard-00001.safetensors",
    ]


def test_extracted_shards_equal_a_direct_forward(make_cfg, own_artifacts, tiny_target):
    cfg = tiny_cfg(make_cfg, own_artifacts)
    out = extract.run(cfg)
    assert out.complete and out.upstream == {"data": outputs.data_output(cfg).hash}
    splits = load_splits(outputs.data_output(cfg).path)
    index = json.loads((out.path / "index.json").read_text())
    assert index["hidden_size"] == 64 and index["aux_layer_ids"] == [1, 2, 3]
    assert len(index["splits"]["train"]) > 2  # several shards, several padded batches each
    counts = out.manifest()["counts"]
    assert counts["tokens"] == sum(map(len, splits["train"]["input_ids"])) + sum(
        map(len, splits["val"]["input_ids"])
    )
    assert counts["bytes_written"] == sum(s["bytes"] for v in index["splits"].values() for s in v)
    for split in ("train", "val"):
        shards = ShardDataset(out.path, split)
        assert len(shards) == len(splits[split])
        for i in range(len(shards)):
            item, row = shards[i], splits[split][i]
            assert item["id"] == row["id"]
            assert (
                item["input_ids"].dtype == torch.long
                and item["input_ids"].tolist() == row["input_ids"]
            )
            assert item["loss_mask"].tolist() == row["loss_mask"]
            aux, last = reference_states(tiny_target, row["input_ids"])
            assert_bf16_equal(item["aux_hidden"], aux)
            assert_bf16_equal(item["last_hidden"], last)
    for shard in (out.path / "train").iterdir():
        assert shard.suffix == ".safetensors"  # no pickles, no leftovers
    stamp = (out.path / "index.json").stat().st_mtime_ns
    extract.run(cfg)
    assert (out.path / "index.json").stat().st_mtime_ns == stamp  # complete: a rerun is a no-op


def test_online_capture_is_the_offline_path(tiny_target):
    """Training's online mode calls extract.hidden_states: padded rows give each sequence's own states."""
    seqs = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    aux, last = extract.hidden_states(tiny_target, extract.right_padded(seqs, pad_id=2))
    for row, seq in enumerate(seqs):
        ref_aux, ref_last = reference_states(tiny_target, seq)
        torch.testing.assert_close(aux[row, : len(seq)], ref_aux, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(last[row, : len(seq)], ref_last, rtol=1e-5, atol=1e-6)


def shard_files(out_path):
    return sorted((out_path / "train").glob("*.safetensors"))


def test_rerun_redoes_only_missing_and_damaged_shards(make_cfg, own_artifacts):
    cfg = tiny_cfg(make_cfg, own_artifacts)
    out = extract.run(cfg)
    files = shard_files(out.path)
    reference = {
        f.name: {k: v.clone() for k, v in load_file(str(f)).items()} for f in files
    }  # not mmap views
    stamps = {f.name: f.stat().st_mtime_ns for f in files}
    # an interrupted run's leftovers: a missing shard, a truncated one, a half-written temp file
    files[0].unlink()
    files[1].write_bytes(files[1].read_bytes()[:1000])
    (out.path / "train" / "shard-00099.tmp").write_bytes(b"partial")
    manifest = out.manifest()
    out.manifest_path.write_text(json.dumps({**manifest, "complete": False}))
    again = extract.run(cfg)
    counts = again.manifest()["counts"]
    assert again.complete and counts["shards_resumed"] == counts["shards"] - 2
    assert not list((out.path / "train").glob("*.tmp"))
    for f in shard_files(out.path):
        tensors = load_file(str(f))
        assert tensors.keys() == reference[f.name].keys()
        assert all(torch.equal(tensors[k], reference[f.name][k]) for k in tensors)
        if f.name not in (files[0].name, files[1].name):
            assert f.stat().st_mtime_ns == stamps[f.name]  # verified shards were not rewritten


def test_verification_catches_bad_states_and_wrong_tokens(
    make_cfg, own_artifacts, tiny_target, tmp_path
):
    """Simulated faults: a real target does not emit NaN and a real run writes the right ids, so the
    tensors are altered by hand to show the checks fire."""
    cfg = tiny_cfg(make_cfg, own_artifacts)
    out = extract.run(cfg)
    splits = load_splits(outputs.data_output(cfg).path)
    plan = extract.plan_shards("train", splits["train"][:], cfg.extract.shard_tokens)[0]
    tensors = load_file(str(out.path / plan.file))
    extract.check_shard(out.path / plan.file, plan, 64, full=True)  # the real shard passes
    (tmp_path / "train").mkdir()
    nan = {**tensors, "aux_hidden": tensors["aux_hidden"].clone()}
    nan["aux_hidden"][3, 5] = float("nan")
    with pytest.raises(Eagle3Error, match="non-finite"):
        extract.write_shard(nan, plan, tmp_path, 64, verify=True)
    wrong = {**tensors, "input_ids": tensors["input_ids"].clone()}
    wrong["input_ids"][0] += 1
    with pytest.raises(Eagle3Error, match="token ids differ"):
        extract.write_shard(wrong, plan, tmp_path, 64, verify=True)
    assert not list((tmp_path / "train").iterdir())  # nothing left under either name


def test_disk_estimate_and_refusal(tmp_path, capsys):
    assert extract.disk_estimate(10_000_000, 576, torch.bfloat16) == 10_000_000 * (4 * 576 * 2 + 5)
    extract.check_disk(tmp_path, 1000, 1000, 576, torch.bfloat16, 1.1)
    assert "4.6 kB/token" in capsys.readouterr().out
    with pytest.raises(Eagle3Error, match="train.hidden_states=online"):
        extract.check_disk(tmp_path, 10**13, 10**13, 576, torch.bfloat16, 1.1)


def test_kill_9_during_extraction_resumes_with_verified_shards(
    make_cfg, own_artifacts, test_root, tiny_target
):
    overrides = [
        f"paths.artifacts={own_artifacts}",
        "target=tiny-llama",
        "tracking.enabled=false",
        "data.limit=24",
        "data.max_length=1024",
        "drafter.draft_vocab_size=256",
        "extract.shard_tokens=1024",
        "extract.batch_tokens=2048",
    ]
    cfg = make_cfg(*overrides)
    data.run(cfg)  # ShareGPT, so the extraction has enough shards to be cut short
    out = outputs.extract_output(cfg)
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagle3.extract", f"paths.root={test_root}", *overrides],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 600
    while not list(out.path.glob("train/*.safetensors")):
        assert proc.poll() is None and time.time() < deadline, (
            "extraction ended before it could be interrupted"
        )
        time.sleep(0.02)
    proc.kill()  # SIGKILL: no cleanup code runs
    proc.wait()
    at_kill = len(list((out.path / "train").glob("*.safetensors")))
    assert not out.complete and not (out.path / "index.json").exists()
    out = extract.run(cfg)
    counts = out.manifest()["counts"]
    assert out.complete and at_kill <= counts["shards_resumed"] < counts["shards"]
    splits = load_splits(outputs.data_output(cfg).path)
    plans = [
        p
        for s in ("train", "val")
        for p in extract.plan_shards(s, splits[s][:], cfg.extract.shard_tokens)
    ]
    for plan in plans:
        extract.check_shard(out.path / plan.file, plan, 64, full=True)
    shards = ShardDataset(out.path, "train")
    assert [shards[i]["id"] for i in range(len(shards))] == splits["train"][
        "id"
    ]  # none lost, none twice
    for i in (0, len(shards) // 2, len(shards) - 1):
        aux, last = reference_states(tiny_target, splits["train"][i]["input_ids"])
        assert_bf16_equal(shards[i]["aux_hidden"], aux)
        assert_bf16_equal(shards[i]["last_hidden"], last)


@pytest.mark.slow
def test_smollm2_sharegpt_end_to_end(make_cfg, own_artifacts, smollm2):
    """A handful of real ShareGPT conversations through data -> extract; one stored sample's states
    equal a fresh SmolLM2 forward's hidden_states[2, 15, 27] and the final hidden state."""
    cfg = make_cfg(
        f"paths.artifacts={own_artifacts}",
        "target=smollm2-135m",
        "target.dtype=float32",
        "data.limit=5",
        "data.max_length=256",
        "data.val_fraction=0.2",
        "extract.shard_tokens=512",
    )
    out = extract.run(cfg)
    splits = load_splits(outputs.data_output(cfg).path)
    counts = outputs.data_output(cfg).manifest()[
        "counts"
    ]  # a long first prompt can leave no answer at 256 tokens
    assert (
        len(splits["train"]) + len(splits["val"]) + counts.get("dropped_no_assistant_tokens", 0)
        == 5
    )
    assert len(splits["train"]) >= 2
    shards = ShardDataset(out.path, "train")
    item, row = shards[1], splits["train"][1]
    assert item["id"] == row["id"] and item["input_ids"].tolist() == row["input_ids"]
    assert item["aux_hidden"].shape == (len(row["input_ids"]), 3 * 576)
    with torch.no_grad():
        hs = smollm2.model(
            torch.tensor([row["input_ids"]]), output_hidden_states=True
        ).hidden_states
    assert_bf16_equal(item["aux_hidden"], torch.cat([hs[2], hs[15], hs[27]], dim=-1)[0])
    assert_bf16_equal(item["last_hidden"], hs[30][0])
    # the loss mask covers the assistant turns: decoded, they are the conversation's answers
    tok = smollm2.tokenizer
    masked = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert masked.count("<|im_end|>") >= 1 and "<|im_start|>" not in masked


def test_a_finished_shard_cut_short_or_changed_is_named_before_it_is_read(make_cfg, own_artifacts):
    """The manifest lists each file's size and sha256: a shard cut short after the output finished
    stops the extract rerun and training (before its MLflow run) naming the shard; a shard changed
    at its full size passes the size check and is caught with verify=true."""
    from mlflow.tracking import MlflowClient

    from eagle3.train import stage as train

    cfg = tiny_cfg(make_cfg, own_artifacts, "train.hidden_states=offline")
    out = extract.run(cfg)
    files = shard_files(out.path)
    listed = out.manifest()["files"][f"train/{files[1].name}"]
    assert listed["size"] == files[1].stat().st_size and len(listed["sha256"]) == 64
    whole = files[1].read_bytes()
    files[1].write_bytes(whole[:1000])
    damaged = (
        f"{files[1]} has 1,000 bytes where its manifest says {len(whole):,} (cut short or "
        f"changed); the output {out.path} is damaged: remove that folder and rerun "
        "`python -m eagle3.extract` to redo it"
    )
    with pytest.raises(Eagle3Error) as err:
        extract.run(cfg)
    assert str(err.value) == damaged
    client = MlflowClient(cfg.tracking.uri)
    runs = lambda: client.search_runs(  # noqa: E731
        [e.experiment_id for e in client.search_experiments()]
    )
    before = len(runs())
    with pytest.raises(Eagle3Error) as err:
        train.run(cfg)
    assert str(err.value) == damaged and len(runs()) == before
    flipped = bytearray(whole)
    flipped[-1] ^= 1  # the same size, one bit changed in the last tensor's data
    files[1].write_bytes(bytes(flipped))
    assert extract.run(cfg).path == out.path  # sizes agree: not hashed by default
    with pytest.raises(Eagle3Error) as err:
        extract.run(tiny_cfg(make_cfg, own_artifacts, "train.hidden_states=offline", "verify=true"))
    assert str(err.value).startswith(f"{files[1]} differs from the sha256 its manifest records")
