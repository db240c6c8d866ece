"""Sweeps over load (eagle3.bench.concurrency): the fastest shape and what to run per batch size, the schedule's
SGLang and vLLM flags (SGLang's own parser reads them back), step costs per batch size."""

from __future__ import annotations

import json

import pytest
from support import LOAD_DRAFTER as DRAFTER
from support import SGLANG_PYTHON
from support import load_results as results

from eagle3.bench.concurrency import per_batch_rows, schedule, step_cost_rows, write_load_summary
from eagle3.serve.launch import sglang_parse_many


def test_per_batch_choice_and_schedule():
    rows = per_batch_rows(results())
    assert [(r["batch_size"], r["fastest"], r["speedup"], r["run"]) for r in rows] == [
        (1, "d32s4k8", 2.5, "d32s4k8"),
        (16, "d8", 1.04, "off"),
    ]
    (plan,) = schedule(results())
    one, sixteen = plan["entries"]
    assert one["spec"]["label"] == "d32s4k8" and one["vllm_chain"]["label"] == "d8"
    assert sixteen["spec"]["label"] == "off" and sixteen["fastest"]["label"] == "d8"
    assert sixteen["sglang_args"] == ["--max-running-requests", "16"]
    assert one["vllm_args"][:2] == ["--max-num-seqs", "1"]
    config = json.loads(one["vllm_args"][3])
    assert config == {"method": "eagle3", "model": DRAFTER, "num_speculative_tokens": 7}
    assert sixteen["vllm_args"] == ["--max-num-seqs", "16"]  # no chain beat spec=off at 16


def test_step_costs_per_batch_size():
    """The chain line through (1, off) and (8, d8) at each batch size: verify = off's step, per depth
    = (d8 - off) / 7."""
    rows = {r["batch_size"]: r for r in step_cost_rows(results())}
    assert rows[1]["verify_ms"] == pytest.approx(10.0) and rows[1]["per_depth_ms"] == pytest.approx(
        10 / 7, abs=1e-3
    )
    assert rows[16]["off_step_ms"] == 16.0 and rows[16]["per_depth_ms"] == pytest.approx(
        34 / 7, abs=1e-3
    )
    assert rows[16]["shapes_step_ms"] == "d8 50.000, d32s4k8 60.000"


def test_summary_files_and_schedule_beside_the_drafter(tmp_path):
    export = tmp_path / "export" / "abc123"
    (export / "sglang").mkdir(parents=True)
    jobs = results()
    for j in jobs:
        if j["drafter"]:
            j["drafter"] = str(export / "sglang")
    files = write_load_summary(jobs, tmp_path)
    assert {f.name for f in files} == {"load.md", "schedule.json", "speedup_by_batch.png"}
    assert json.loads((export / "schedule.json").read_text()) == json.loads(
        (tmp_path / "schedule.json").read_text()
    )
    text = (tmp_path / "load.md").read_text()
    assert "batch 16: fastest d8 at 1.04x spec=off (0.94-1.14x); run spec=off" in text


def test_schedule_flags_parse_in_sglang():
    """Each entry's SGLang flags after a model path go through SGLang's own parser."""
    assert SGLANG_PYTHON.exists(), "run `make sglang` (tools/setup_sglang.sh) to build .venv-sglang"
    (plan,) = schedule(results())
    argvs = [["--model-path", "/models/target", *e["sglang_args"]] for e in plan["entries"]]
    one, sixteen = sglang_parse_many(str(SGLANG_PYTHON), argvs)
    assert "error" not in one and "error" not in sixteen, (one, sixteen)
    parsed = one["parsed"]
    assert (
        parsed["speculative_algorithm"],
        parsed["speculative_num_steps"],
        parsed["speculative_eagle_topk"],
        parsed["speculative_num_draft_tokens"],
        parsed["speculative_draft_model_path"],
    ) == ("EAGLE3", 4, 8, 32, DRAFTER)
    assert sixteen["parsed"]["speculative_algorithm"] is None
