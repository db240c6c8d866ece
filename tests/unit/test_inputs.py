"""Changed and bad inputs are never used silently: an edited prompt file gets a new data hash, a
broken JSON element stops the stage naming it, incomplete or other-engine drafter exports are
refused, and bad bench settings are one-line errors before anything is launched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter

import pytest
from support import randomise

from eagle3.bench import app as bench
from eagle3.core import outputs
from eagle3.core.common import Eagle3Error
from eagle3.core.drafter import build_drafter
from eagle3.data.sources import read_rows
from eagle3.data.suites import check_bench_settings
from eagle3.export.stage import export_drafter


def rows_file(path, count: int) -> list[dict]:
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(count)
    ]
    return rows


# ---------------------------------------------------------------- the data stage's inputs


def test_data_hash_follows_the_contents_of_a_local_source(make_cfg, tmp_path):
    source = tmp_path / "prompts.jsonl"
    source.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    cfg = make_cfg("target=tiny-llama", "data=file", f"data.source={source}")
    first = outputs.data_output(cfg)
    assert first.config["source_fingerprint"]["size"] == source.stat().st_size
    source.write_text('{"prompt": "one"}\n{"prompt": "TWO"}\n')  # same size, new contents
    edited = outputs.data_output(cfg)
    assert edited.hash != first.hash
    os.utime(source, ns=(1, 1))  # touched, contents unchanged: the same output
    assert outputs.data_output(cfg).hash == edited.hash
    packaged = outputs.data_output(make_cfg("target=tiny-llama"))
    assert "source_fingerprint" not in packaged.config  # shipped and hub sources: as before


def test_a_broken_element_inside_a_json_array_is_named(tmp_path):
    rows = [json.dumps(r) for r in rows_file(tmp_path, 41)]
    rows[3] = '{"messages": [{"role": "user", "content": "q3"}'  # element 4: unclosed
    path = tmp_path / "rows.json"
    path.write_text("[\n" + ",\n".join(rows) + "\n]\n")
    with pytest.raises(Eagle3Error) as err:
        list(read_rows_of(path))
    assert str(err.value) == (
        f"data.source {path}: element 4 of the JSON array (from line 5) is not valid JSON: "
        "Expecting ',' delimiter (line 44, column 1)"
    )


def test_a_json_array_cut_off_at_the_end_keeps_its_complete_rows(tmp_path):
    rows = [json.dumps(r) for r in rows_file(tmp_path, 5)]
    path = tmp_path / "rows.json"
    path.write_text("[" + ",".join(rows)[:-30])  # a download cut short
    counts = Counter()
    assert len(list(read_rows_of(path, counts))) == 4 and counts["truncated_tail"] == 1


def test_a_json_array_without_its_end_and_a_broken_element_inside_is_an_error(tmp_path):
    rows = [json.dumps(r) for r in rows_file(tmp_path, 20)]
    rows[3] = '{"messages": [{"role": "user", "content": "q3"}'  # element 4: unclosed
    path = tmp_path / "rows.json"
    path.write_text("[\n" + ",\n".join(rows)[:-30])  # and the file cut before its "]"
    with pytest.raises(Eagle3Error) as err:
        list(read_rows_of(path))
    assert str(err.value).startswith(
        f"data.source {path}: element 4 of the JSON array (from line 5) is not valid JSON"
    )


@pytest.mark.parametrize("tail", ['{"messages": [{"ro', '{"messages": [', '{"a": tr', '{"a": 1, '])
def test_a_json_array_cut_inside_its_last_element_keeps_every_complete_one(tmp_path, tail):
    rows = [json.dumps(r) for r in rows_file(tmp_path, 6)]
    path = tmp_path / "rows.json"
    path.write_text("[\n" + ",\n".join(rows) + ",\n" + tail)
    counts = Counter()
    assert len(list(read_rows_of(path, counts))) == 6 and counts["truncated_tail"] == 1


def read_rows_of(path, counts=None):
    from omegaconf import OmegaConf

    return read_rows(
        OmegaConf.create({"source": str(path)}), Counter() if counts is None else counts
    )


def test_jsonl_with_a_byte_order_mark_or_a_bad_first_line_keeps_its_good_rows(tmp_path):
    lines = [json.dumps(r) for r in rows_file(tmp_path, 3)]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
    counts = Counter()
    assert [r["messages"][0]["content"] for r in read_rows_of(bom, counts)] == ["q0", "q1", "q2"]
    assert counts["invalid_json"] == 0
    bad_first = tmp_path / "bad.jsonl"
    bad_first.write_text("this is not json\n" + "\n".join(lines))
    counts = Counter()
    assert len(list(read_rows_of(bad_first, counts))) == 3 and counts["invalid_json"] == 1
    nothing = tmp_path / "nothing.jsonl"
    nothing.write_text("not json\nnor this\n")
    with pytest.raises(Eagle3Error, match="not a JSON array or JSON lines file"):
        list(read_rows_of(nothing))


def test_a_directory_is_not_called_missing(tmp_path):
    folder = tmp_path / "prompts.jsonl"
    folder.mkdir()
    with pytest.raises(Eagle3Error) as err:
        list(read_rows_of(folder))
    assert str(err.value) == (
        f"data.source {folder} is a directory: give a .json, .jsonl or .parquet file"
    )
    with pytest.raises(Eagle3Error, match="no such file"):
        list(read_rows_of(tmp_path / "missing.jsonl"))


# ---------------------------------------------------------------- drafter exports


@pytest.fixture
def export_dir(tiny_target, make_cfg, tmp_path):
    cfg = make_cfg("target=tiny-llama")
    drafter = randomise(build_drafter(tiny_target, cfg.drafter))
    drafter.config.aux_layer_ids = [1, 2, 3]  # custom ids: the folders' conventions differ
    export_drafter(cfg.export, cfg.target, drafter, {"tau_hat": 1.0}, tmp_path / "exp")
    return tmp_path / "exp"


def resolve(make_cfg, path, engine):
    return outputs.resolve_drafter_path(make_cfg(f"drafter.path={path}"), engine)


def test_an_engine_gets_only_its_own_convention(export_dir, make_cfg):
    assert resolve(make_cfg, export_dir, "vllm") == export_dir / "vllm"
    assert resolve(make_cfg, export_dir, "sglang") == export_dir / "sglang"
    assert resolve(make_cfg, export_dir / "vllm", "local") == export_dir / "vllm"
    with pytest.raises(Eagle3Error) as err:
        resolve(make_cfg, export_dir / "sglang", "vllm")
    assert str(err.value) == (
        f"{export_dir / 'sglang'} was written for sglang (aux-layer ids in sglang's convention); "
        "serve=vllm needs the vllm/ folder of the export"
    )
    shutil.rmtree(export_dir / "vllm")  # no fallback to the sglang/ folder
    with pytest.raises(Eagle3Error) as err:
        resolve(make_cfg, export_dir, "vllm")
    assert str(err.value) == (
        f"{export_dir} holds no drafter for serve=vllm "
        "(no vllm/config.json or speculators/config.json)"
    )


def test_incomplete_exports_are_refused_by_path(export_dir, make_cfg):
    (export_dir / "manifest.json").write_text(json.dumps({"stage": "export", "complete": False}))
    for path in (export_dir, export_dir / "sglang"):
        with pytest.raises(Eagle3Error, match="incomplete export .*complete: false"):
            resolve(make_cfg, path, "sglang")
    (export_dir / "manifest.json").write_text(json.dumps({"complete": True}))
    assert resolve(make_cfg, export_dir, "sglang") == export_dir / "sglang"
    (export_dir / "sglang" / "model.safetensors").unlink()
    with pytest.raises(Eagle3Error, match="has a config.json but no weights"):
        resolve(make_cfg, export_dir, "sglang")
    partial = export_dir / "vllm.partial"
    shutil.copytree(export_dir / "vllm", partial)
    with pytest.raises(Eagle3Error, match="half-written export folder"):
        resolve(make_cfg, partial, "vllm")


# ---------------------------------------------------------------- bench settings


@pytest.mark.parametrize(
    "override, message",
    [
        ("bench.batch_size=0", "bench.batch_size=0: must be an integer >= 1"),
        ("bench.max_new_tokens=0", "bench.max_new_tokens=0: must be an integer >= 1"),
        ("bench.max_new_tokens=-5", "bench.max_new_tokens=-5: must be an integer >= 1"),
        ("bench.limit=0", "bench.limit=0: must be a number of prompts >= 1, or null for all"),
        ("bench.limit=-1", "bench.limit=-1: must be a number of prompts >= 1, or null for all"),
        ("spec.depth=100000", "spec.depth=100000 exceeds serve.max_depth=128"),
    ],
)
def test_bad_bench_settings_are_refused_before_launch(make_cfg, tmp_path, override, message):
    cfg = make_cfg("target=tiny-llama", "serve.drafter_fallback=untrained", override)
    with pytest.raises(Eagle3Error) as err:
        bench.measure_job(bench.bench_job(cfg), tmp_path / "job")
    assert str(err.value).startswith(message)
    assert not (tmp_path / "job").exists()  # no engine folder, nothing launched


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("p.jsonl", '{"prompt": "a"}\n{"prompt": \n', "line 2 is not JSON"),
        ("p.json", '[{"prompt": "a"}, ', "is not JSON (line 1, column 19"),
        ("p.jsonl", '["a list"]\n', "row 0: expected a JSON object, got list"),
        ("dir.jsonl", None, "is a directory: give a .jsonl or .json file of prompts"),
    ],
)
def test_malformed_bench_prompts_are_one_line(make_cfg, tmp_path, name, text, message):
    path = tmp_path / name
    path.mkdir() if text is None else path.write_text(text)
    cfg = make_cfg("target=tiny-llama", "spec=off", f"bench.prompts={path}")
    with pytest.raises(Eagle3Error, match=message.replace("(", r"\(").replace("[", r"\[")):
        bench.measure_job(bench.bench_job(cfg), tmp_path / "job")
    assert not (tmp_path / "job").exists()


def test_bench_limit_null_is_every_prompt(make_cfg):
    from eagle3.data.suites import load_suite

    cfg = make_cfg("bench.limit=null")
    check_bench_settings(cfg.bench)
    assert len(load_suite(cfg.bench)) == 80
    assert len(load_suite(make_cfg("bench.limit=3").bench)) == 3


def test_bench_app_prints_one_line_for_a_zero_batch(test_root, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3.bench",
            f"paths.root={tmp_path}",
            f"paths.artifacts={test_root / 'artifacts'}",
            "tracking.enabled=false",
            "target=tiny-llama",
            "bench.batch_size=0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "eagle3 error: bench.batch_size=0: must be an integer >= 1"
        "  (add debug=true for the traceback)"
    )
    assert not list(tmp_path.rglob("engine.log"))
