"""bench.check_outputs: each request's output ids kept in the run's files, and each shape's outputs
compared with spec=off's (how many equal; the first divergence and the target's logit margin there)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from engine_helpers import PROMPTS, reference_greedy

from eagle3.bench.app import run_job
from eagle3.bench.outputcheck import check_output_settings, compare_outputs
from eagle3.core.common import Eagle3Error
from eagle3.core.target import load_target
from eagle3.serve import inprocess


def test_first_divergence_and_its_margin(make_cfg, tiny_target):
    """Three outputs against spec=off's greedy decodes: one equal, one with its 6th token replaced,
    one cut after 8 tokens. The margin is the target's logit of spec=off's token minus the other's,
    after the prompt and the 5 common tokens (a direct forward)."""
    cfg = make_cfg("target=tiny-llama")
    prompts = [tiny_target.tokenizer(text)["input_ids"] for text in PROMPTS[:3]]
    off = [reference_greedy(tiny_target.model, p, 12) for p in prompts]
    changed = list(off[1])
    changed[5] = (changed[5] + 7) % tiny_target.vocab_size
    load = functools.partial(load_target, cfg.target, cfg.paths.artifacts)
    check = compare_outputs(prompts, off, [off[0], changed, off[2][:8]], load)
    with torch.no_grad():
        logits = tiny_target.model(torch.tensor([prompts[1] + off[1][:5]])).logits[0, -1]
    margin = float(logits[off[1][5]] - logits[changed[5]])
    assert check["outputs_compared"] == 3 and check["outputs_equal_off"] == 1
    first, cut = check["output_divergences"]
    assert first["prompt"] == 1 and first["position"] == 5
    assert (first["off_token"], first["token"]) == (off[1][5], changed[5])
    assert first["margin"] == pytest.approx(margin, rel=1e-6) and first["margin"] > 0
    assert cut == {"prompt": 2, "position": 8, "margin": None}
    with pytest.raises(Eagle3Error, match="kept 3 outputs and this shape 2"):
        compare_outputs(prompts, off, off[:2], load)


def test_settings_that_cannot_be_checked(make_cfg):
    with pytest.raises(Eagle3Error, match="bench.temperature=0.7 samples"):
        cfg = make_cfg("bench.check_outputs=true", "bench.temperature=0.7")
        check_output_settings(cfg.bench, cfg.serve.engine)
    with pytest.raises(Eagle3Error, match="serve=vllm does not return"):
        cfg = make_cfg("bench.check_outputs=true", "serve=vllm")
        check_output_settings(cfg.bench, cfg.serve.engine)


def test_a_bench_job_keeps_and_compares_outputs(make_cfg, tmp_path):
    """A d4 job in-process with check_outputs: every request's output ids are in requests.json of
    both measurements, and the chain's outputs equal spec=off's (greedy, float32: lossless)."""
    cfg = make_cfg(
        "target=tiny-llama",
        "tracking.enabled=false",
        "bench.repeats=1",
        "bench.warmup=0",
        "bench.limit=3",
        "bench.max_new_tokens=12",
        "bench.ignore_eos=true",
        "bench.check_outputs=true",
        "spec.depth=4",
        "serve.drafter_fallback=untrained",
        "serve.inprocess=true",
    )
    result = run_job(cfg, tmp_path / "job")
    inprocess.release()
    assert result["status"] == "ok", result.get("error")
    assert result["outputs_compared"] == result["outputs_equal_off"] == 3
    assert result["output_divergences"] == []
    kept = {}
    for part in ("baseline", "spec"):
        (records,) = json.loads((tmp_path / "job" / part / "requests.json").read_text())
        kept[part] = [r["output_ids"] for r in records]
    assert kept["spec"] == kept["baseline"] and all(len(ids) == 12 for ids in kept["spec"])
    check = json.loads((tmp_path / "job" / "output_check.json").read_text())
    assert check["outputs_equal_off"] == 3
