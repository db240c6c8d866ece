"""serve.inprocess: the bench measuring the embedded engine and HF generate inside its own process,
and a bench job over several suites."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from engine_helpers import PROMPTS

from eagle3.bench.app import run_job
from eagle3.core.artifacts import folder_lock
from eagle3.core.common import Eagle3Error, compose
from eagle3.core.spec import resolve_spec
from eagle3.data.suites import load_suite, suite_name
from eagle3.export.stage import export_drafter
from eagle3.serve import inprocess
from eagle3.serve.counters import counter_delta
from eagle3.serve.launch import engine_setup

TINY = ("target=tiny-llama", "tracking.enabled=false", "bench.repeats=1", "bench.warmup=1")


@pytest.fixture(scope="module")
def drafter(test_root, tiny_target, tiny_fitted_drafter):
    """The drafter fitted to tiny-llama's greedy rollouts, exported: it gets drafts accepted."""
    out = test_root / "drafters" / "tiny-fitted"
    with folder_lock(out):  # test workers started at once export it once
        if not (out / "vllm" / "config.json").exists():
            export_fitted(test_root, tiny_target, tiny_fitted_drafter, out)
    return out


def export_fitted(test_root, tiny_target, tiny_fitted_drafter, out) -> None:
    cfg = compose([f"paths.root={test_root}", "target=tiny-llama"])
    fitted = copy.deepcopy(tiny_fitted_drafter)
    fitted.config.target_num_layers = tiny_target.num_layers
    # the exporter wants every draft slot mapped: the fitted tokens first, then unused ones
    seen = fitted.t2d.nonzero().flatten().tolist()
    size = fitted.config.draft_vocab_size
    rest = [t for t in range(tiny_target.vocab_size) if t not in set(seen)][: size - len(seen)]
    vocab = torch.tensor(seen + rest)
    t2d = torch.zeros(tiny_target.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    fitted.set_vocab_map(vocab - torch.arange(size), t2d)
    export_drafter(
        cfg.export,
        cfg.target,
        fitted,
        {"note": "fitted to tiny-llama's rollouts, for engine tests"},
        out,
    )


def test_several_suites_are_the_first_prompts_of_each(make_cfg):
    both = make_cfg("bench.suite=[vicuna,gsm8k]", "bench.limit=2").bench
    assert load_suite(both) == (
        load_suite(make_cfg("bench.suite=vicuna", "bench.limit=2").bench)
        + load_suite(make_cfg("bench.suite=gsm8k", "bench.limit=2").bench)
    )
    assert suite_name(both) == "vicuna+gsm8k"
    with pytest.raises(Eagle3Error, match="unknown bench.suite 'nope'"):
        load_suite(make_cfg("bench.suite=[vicuna,nope]").bench)


def requests_of(folder) -> list[dict]:
    (records,) = json.loads((folder / "requests.json").read_text())
    return records


def test_inprocess_measures_what_the_server_measures(make_cfg, tmp_path, drafter):
    """The same greedy float32 job through the local server and in-process: every request's token
    count and verify steps, and the acceptance per position, are equal."""
    shared = (
        *TINY,
        "spec.depth=4",
        "bench.suite=[vicuna,gsm8k]",
        "bench.limit=2",
        "bench.max_new_tokens=24",
        f"drafter.path={drafter}",
    )
    served = run_job(make_cfg(*shared), tmp_path / "served")
    inside = run_job(make_cfg(*shared, "serve.inprocess=true"), tmp_path / "inside")
    inprocess.release()
    assert served["status"] == inside["status"] == "ok", (served.get("error"), inside.get("error"))
    assert served["suite"] == inside["suite"] == "vicuna+gsm8k"
    a, b = requests_of(tmp_path / "served" / "spec"), requests_of(tmp_path / "inside" / "spec")
    assert len(a) == len(b) == 4
    for key in ("prompt_tokens", "output_tokens", "verify_steps"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert inside["accept_length"] == pytest.approx(served["accept_length"])
    assert inside["accept_per_pos"] == pytest.approx(served["accept_per_pos"])
    assert all(r["ttft_s"] is not None and 0 < r["ttft_s"] <= r["latency_s"] for r in b)


def test_counters_before_a_pass_stay_as_they_were(make_cfg, drafter, tiny_target):
    """The bench reads engine.counters() before and after a pass and keeps the difference: the
    acceptance per position of a pass in-process is the pass's own, not zero (the fitted drafter on
    the prompts it was fitted to accepts drafts at the first position)."""
    cfg = make_cfg(*TINY, "spec.depth=4", f"drafter.path={drafter}", "serve.inprocess=true")
    spec = resolve_spec(cfg.spec)
    engine = inprocess.engine_for(engine_setup(cfg), spec, drafter, None)
    prompts = [tiny_target.tokenizer(text)["input_ids"] for text in PROMPTS]
    before = engine.counters()
    copied = json.loads(json.dumps(before))
    engine.run(prompts, cfg.bench, "pass")
    inprocess.release()
    assert before == copied
    assert counter_delta(before, engine.counters())["accepted_per_pos"][0] > 0


def test_an_engine_is_kept_for_the_next_job_with_its_config(make_cfg, drafter):
    cfg = make_cfg(*TINY, "spec.depth=4", "serve.inprocess=true", f"drafter.path={drafter}")
    spec = resolve_spec(cfg.spec)
    first = inprocess.engine_for(engine_setup(cfg), spec, drafter / "sglang", None)
    assert inprocess.engine_for(engine_setup(cfg), spec, drafter / "sglang", None) is first
    deeper = make_cfg(*TINY, "spec.depth=5", "serve.inprocess=true", f"drafter.path={drafter}")
    other = inprocess.engine_for(
        engine_setup(deeper), resolve_spec(deeper.spec), drafter / "sglang", None
    )
    assert other is not first and inprocess._KEPT["engine"] is other
    inprocess.release()
    assert not inprocess._KEPT


def test_hf_generate_counts_through_the_first_eos(make_cfg, tmp_path):
    assert inprocess.completion_length([5, 2, 7, 2], eos=2) == 2
    assert inprocess.completion_length([5, 7, 9], eos=2) == 3
    assert inprocess.completion_length([2, 2], eos=2) == 1
    cfg = make_cfg(
        *TINY,
        "serve=hf",
        "spec=off",
        "bench.limit=3",
        "bench.batch_size=2",
        "bench.max_new_tokens=12",
        "bench.ignore_eos=true",
    )
    result = run_job(cfg, tmp_path / "hf")
    inprocess.release()
    assert result["status"] == "ok", result.get("error")
    assert result["output_tokens"] == 3 * 12 and result["requests"] == 3
    assert result["engine_version"].startswith("transformers ")
    records = requests_of(tmp_path / "hf" / "baseline")
    # static batches of 2: the first two requests share one batch's wall time
    assert records[0]["latency_s"] == records[1]["latency_s"] != records[2]["latency_s"]


def test_hf_refuses_a_speculative_spec(make_cfg, tmp_path):
    result = run_job(make_cfg(*TINY, "serve=hf", "spec.depth=4"), tmp_path / "hf")
    assert result["status"] == "failed" and "does not speculate: use spec=off" in result["error"]


def test_inprocess_refused_for_a_served_engine(make_cfg, tmp_path):
    result = run_job(make_cfg(*TINY, "serve=vllm", "serve.inprocess=true"), tmp_path / "v")
    assert result["status"] == "failed" and "vllm runs as its own server" in result["error"]
