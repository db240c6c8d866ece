"""Repeats, ranges, ties and the sweep's verdict (eagle3.bench.verdict, eagle3.bench.sweep.summarize), and the
spec=off baseline measured once per sweep unless reuse is asked for."""

import csv
import functools
import json
import time

import pytest

from eagle3.bench.baseline import BaselineIdentity, baseline
from eagle3.bench.costmodel import StepCost, accept_length
from eagle3.bench.engines import open_engine
from eagle3.bench.measurement import measure
from eagle3.bench.sweep import summarize
from eagle3.bench.verdict import Rules, Spread, combine_repeats, speedup_fields, winner
from eagle3.core.spec import OFF
from eagle3.core.target import load_target
from eagle3.serve.launch import engine_setup

COST = StepCost(verify_s=0.04, draft_step_s=0.012)  # a CPU-like step: drafting is expensive
PER_POS = [0.75, 0.55, 0.4, 0.3, 0.22, 0.16, 0.12, 0.09, 0.07, 0.05, 0.04, 0.03, 0.02, 0.02, 0.01]
BASE = {"tokens_per_s": 25.0, "tokens_per_s_min": 24.0, "tokens_per_s_max": 26.0}


def job(depth, tok_s, low, high, **extra):
    """A successful chain job measured against BASE, its acceptance and step time from PER_POS and
    COST (the cost model fits them back exactly)."""
    tau = accept_length(PER_POS, depth)
    result = {
        "engine": "local",
        "suite": "vicuna",
        "batch_size": 1,
        "max_new_tokens": 128,
        "status": "ok",
        "spec": f"d{depth}",
        "depth": depth,
        "steps": depth - 1,
        "topk": 1,
        "tokens_per_s": tok_s,
        "tokens_per_s_min": low,
        "tokens_per_s_max": high,
        "baseline_tokens_per_s": BASE["tokens_per_s"],
        "baseline_tokens_per_s_min": BASE["tokens_per_s_min"],
        "baseline_tokens_per_s_max": BASE["tokens_per_s_max"],
        "baseline_step_s": COST.step_s(1),
        "accept_length": tau,
        "step_s": COST.step_s(depth),
        "decode_tokens_per_s": tau / COST.step_s(depth),
        "accept_per_pos": PER_POS[: depth - 1],
        "baseline_reused": False,
        **extra,
    }
    return {**result, **speedup_fields(result, BASE)}


def test_combine_repeats_takes_medians_and_the_range():
    passes = [
        {
            "tokens_per_s": 30.0,
            "decode_tokens_per_s": 31.0,
            "accept_length": 2.0,
            "accept_per_pos": [0.5],
        },
        {
            "tokens_per_s": 20.0,
            "decode_tokens_per_s": 21.0,
            "accept_length": 2.2,
            "accept_per_pos": [0.6],
        },
        {
            "tokens_per_s": 25.0,
            "decode_tokens_per_s": 26.0,
            "accept_length": 2.1,
            "accept_per_pos": [0.7],
        },
    ]
    out = combine_repeats(passes)
    assert (out["tokens_per_s"], out["tokens_per_s_min"], out["tokens_per_s_max"]) == (
        25.0,
        20.0,
        30.0,
    )
    assert out["tokens_per_s_runs"] == [30.0, 20.0, 25.0] and out["repeats"] == 3
    assert out["accept_length"] == 2.1 and out["accept_per_pos"] == [0.7]  # the median pass's list
    assert out["decode_tokens_per_s_min"] == 21.0


def test_speedup_range_divides_extremes_by_the_opposite_extremes():
    fields = speedup_fields(
        {"tokens_per_s": 30.0, "tokens_per_s_min": 27.0, "tokens_per_s_max": 33.0}, BASE
    )
    assert fields == {
        "speedup": pytest.approx(30 / 25),
        "speedup_min": pytest.approx(27 / 26),
        "speedup_max": pytest.approx(33 / 24),
    }
    assert Spread(1, 0, 2).overlaps(Spread(2, 2, 3)) and not Spread(1, 0, 1.9).overlaps(
        Spread(2, 2, 3)
    )


def test_every_shape_slower_than_spec_off_is_said_plainly(make_cfg, tmp_path, capsys):
    """d16 at 0.59x and d10 at 0.65x of spec=off: no "best", no winner; the fastest with its ratio
    and the cost model's predicted best depth with its predicted ratio."""
    results = [job(16, 14.75, 14.2, 15.3), job(10, 16.25, 15.6, 16.9)]
    out = summarize(make_cfg().bench, results, tmp_path)
    printed = capsys.readouterr().out
    assert out["best"] is None and "best" not in printed
    assert (
        "no shape beat spec=off on this machine (all slower): the fastest, d10, ran at 0.65x "
        "(0.60-0.70x) of spec=off" in printed
    )
    assert "d16: 14.8 tok/s (14.2-15.3) = 0.59x spec=off (0.55-0.64x)" in printed
    assert printed.count("slower than spec=off") == 2
    # the cost model recovers COST and PER_POS: tau(D) / step(D) peaks at depth 3 here
    predicted = {d: accept_length(PER_POS, d) / COST.step_s(d) for d in (2, 3, 4, 6, 8, 10, 12, 16)}
    depth = max(predicted, key=predicted.get)
    assert depth == 3
    ratio = predicted[3] * COST.step_s(1)
    assert f"cost model: depth 3 predicted fastest here at {ratio:.2f}x spec=off" in printed
    assert out["verdict"][-1].startswith("cost model: depth 3")
    assert (tmp_path / "verdict.txt").read_text().splitlines() == out["verdict"]
    rows = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert [(r["spec"], r["vs_spec_off"]) for r in rows] == [("d16", "slower"), ("d10", "slower")]
    assert float(rows[1]["speedup_min"]) == pytest.approx(15.6 / 26, abs=1e-4)
    for plot in ("tokens_per_s.png", "speedup.png", "accept_length.png"):
        assert (tmp_path / plot).read_bytes()[:4] == b"\x89PNG"


def test_a_tie_goes_to_the_cheaper_shape(make_cfg, tmp_path, capsys):
    """d4 has the higher median but its range overlaps d3's: d3 wins (fewer verified tokens);
    d8 is beyond noise slower and not part of the tie."""
    results = [job(4, 31.0, 29.5, 32.0), job(3, 30.0, 28.0, 30.5), job(8, 27.0, 26.5, 27.5)]
    chosen, fastest, tied = winner(results)
    assert (chosen["spec"], fastest["spec"]) == ("d3", "d4")
    assert sorted(r["spec"] for r in tied) == ["d3", "d4"]
    out = summarize(make_cfg().bench, results, tmp_path)
    assert out["best"]["spec"] == "d3"
    printed = capsys.readouterr().out
    assert "winner: d3 at 1.20x spec=off (1.08-1.27x); it ties with d4" in printed
    assert (
        "d8: 27.0 tok/s (26.5-27.5) = 1.08x spec=off (1.02-1.15x), tau 3.50: faster than spec=off"
        in printed
    )


def test_a_shape_within_spec_offs_range_is_a_tie_and_spec_off_wins_it(make_cfg, tmp_path, capsys):
    results = [job(3, 26.0, 25.5, 27.0), job(6, 20.0, 19.0, 21.0)]
    out = summarize(make_cfg().bench, results, tmp_path)
    printed = capsys.readouterr().out
    assert out["best"] is None
    assert (
        "d3: 26.0 tok/s (25.5-27.0) = 1.04x spec=off (0.98-1.12x), tau 2.30: a tie with spec=off"
        in printed
    )
    assert "no shape beat spec=off on this machine (within noise): the fastest, d3" in printed


# ---------------------------------------------------------------- the baseline's scope


def identity(cfg):
    return BaselineIdentity(cfg.serve, cfg.bench, cfg.target, cfg.paths.artifacts)


def off_baseline(cfg, target_path, requests, folder, scope):
    """The job's spec=off measurement as a bench job takes it (eagle3.bench.app.measure_job)."""
    opener = functools.partial(
        open_engine, engine_setup(cfg), functools.partial(load_target, cfg), target_path
    )
    off = functools.partial(measure, opener, cfg.bench, cfg.serve.engine, requests, OFF, None)
    return baseline(identity(cfg), off, folder, scope)


def test_baseline_once_per_sweep_and_reused_only_when_asked(make_cfg, own_artifacts, tmp_path):
    """Real spec=off measurements (tiny target, local server): one per sweep, shared by its jobs;
    bench.reuse_baseline=true takes the newest earlier one and says which run and how old."""
    from eagle3.core.target import resolve_target_path

    quick = ("bench.limit=1", "bench.max_new_tokens=4", "bench.warmup=0", "bench.repeats=2")
    cfg = make_cfg("target=tiny-llama", f"paths.artifacts={own_artifacts}", *quick)
    target, requests = resolve_target_path(cfg.target, cfg.paths.artifacts), [[1, 2, 3]]
    first = off_baseline(cfg, target, requests, tmp_path / "job0", "sweep-a")
    again = off_baseline(cfg, target, requests, tmp_path / "job1", "sweep-a")
    assert first["repeats"] == 2 and len(first["tokens_per_s_runs"]) == 2
    assert again["tokens_per_s_runs"] == first["tokens_per_s_runs"]  # read back, not measured
    assert not (tmp_path / "job1" / "baseline").exists()
    off_baseline(
        cfg, target, requests, tmp_path / "job2", "sweep-b"
    )  # another sweep measures its own
    assert (tmp_path / "job2" / "baseline" / "requests.json").exists()
    ages = {"sweep-a": 3600, "sweep-b": 2400}  # sweep-b's is the newer
    for scope, age in ages.items():
        out = identity(cfg).output(scope)
        manifest = json.loads(out.manifest_path.read_text())
        manifest.update(run_id=f"run-{scope}", measured_at=time.time() - age)
        out.manifest_path.write_text(json.dumps(manifest))
    reuse = make_cfg(
        "target=tiny-llama", f"paths.artifacts={own_artifacts}", *quick, "bench.reuse_baseline=true"
    )
    reused = off_baseline(reuse, target, requests, tmp_path / "job3", "sweep-c")
    assert not (tmp_path / "job3" / "baseline").exists()
    assert reused["baseline_reused"] and reused["baseline_run_id"] == "run-sweep-b"
    assert reused["baseline_age_s"] == pytest.approx(2400, abs=60)


def test_a_drafter_the_engine_ignores_is_named_in_the_verdict_and_tagged(
    make_cfg, tmp_path, capsys
):
    """tau under bench.accepts_nothing_tau (1.1): the verdict says in words that the engine accepts
    almost nothing and to check the export, and the job's MLflow run carries the tag `acceptance`;
    a shape accepted normally (d4, tau 2.2) gets neither."""
    from mlflow.tracking import MlflowClient

    from eagle3.bench.runlog import log_job
    from eagle3.core.tracking import stage_run

    cfg = make_cfg()
    ignored = job(8, 14.0, 13.5, 14.5, accept_length=1.02, accept_per_pos=[0.02] + [0.0] * 6)
    accepted = job(4, 30.0, 29.0, 31.0)
    out = summarize(cfg.bench, [ignored, accepted], tmp_path)
    printed = capsys.readouterr().out
    expected = (
        "the engine accepts almost nothing: check the export (d8 tau 1.02, under 1.1): weights the "
        "engine does not load (names, shapes, aux layer ids) leave it drafting at random"
    )
    assert expected in out["verdict"] and printed.count("accepts almost nothing") == 1
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    tags = []
    for result in (ignored, accepted):
        with stage_run(cfg, "bench", run_name=result["spec"]) as run:
            log_job(cfg.bench, cfg.target.name, {**result, "status": "ok"})
        tags.append(client.get_run(run.info.run_id).data.tags.get("acceptance"))
    assert tags == ["the engine accepts almost nothing: check the export", None]


# ---------------------------------------------------------------- what may win


def test_a_shape_that_drafts_nothing_never_wins(make_cfg, tmp_path, capsys):
    """d2 at tau 1.00 is the fastest beyond noise (an untrained drafter on a short suite); it is not
    the winner: d3, the fastest shape that drafts, is. With only shapes that draft nothing there is
    no winner at all, and the verdict says why."""
    untrained = job(2, 33.0, 32.5, 33.5, accept_length=1.0, requests=8)
    drafting = job(3, 30.0, 29.0, 30.5, requests=8)
    rules = Rules(accepts_nothing_tau=1.1, min_prompts=4, min_repeats=3, repeats=3)
    chosen, fastest, tied = winner([untrained, drafting], rules)
    assert (chosen["spec"], fastest["spec"], [r["spec"] for r in tied]) == ("d3", "d3", ["d3"])
    assert winner([untrained, drafting])[0]["spec"] == "d2"  # without the rule it would have won
    out = summarize(make_cfg().bench, [untrained, drafting], tmp_path)
    assert out["best"]["spec"] == "d3"
    assert "winner: d3 at 1.20x spec=off (1.12-1.27x)" in out["verdict"]
    capsys.readouterr()
    out = summarize(make_cfg().bench, [untrained], tmp_path)
    assert out["best"] is None
    assert out["verdict"][-2] == (
        "no winner: every shape's tau is under 1.1 (it drafts almost nothing), whatever its tok/s"
    )


@pytest.mark.parametrize(
    "requests, repeats, said",
    [
        (
            2,
            2,
            "2 prompts per pass (bench.winner_min_prompts=4) and 2 passes per job "
            "(bench.winner_min_repeats=3)",
        ),
        (2, 3, "2 prompts per pass (bench.winner_min_prompts=4)"),
        (8, 2, "2 passes per job (bench.winner_min_repeats=3)"),
        (4, 3, None),
    ],
)
def test_a_sweep_too_small_to_tell_names_no_winner(
    make_cfg, tmp_path, capsys, requests, repeats, said
):
    """d3 beats spec=off's range by 20 %; with fewer prompts per pass than
    bench.winner_min_prompts (4) or fewer passes than bench.winner_min_repeats (3) the verdict
    says the sweep is too small instead of naming it; at exactly 4 prompts and 3 passes it wins."""
    results = [job(3, 30.0, 29.0, 30.5, requests=requests), job(6, 20.0, 19.0, 21.0, requests=8)]
    out = summarize(make_cfg(f"bench.repeats={repeats}").bench, results, tmp_path)
    if said is None:
        assert out["best"]["spec"] == "d3"
        assert "winner: d3 at 1.20x spec=off (1.12-1.27x)" in out["verdict"]
        return
    assert out["best"] is None
    assert out["verdict"][-2] == (
        f"no winner: the sweep is too small to separate shapes from noise: {said}; the fastest, "
        "d3, ran at 1.20x (1.12-1.27x) of spec=off"
    )
    assert not any(line.startswith("winner") for line in out["verdict"])
