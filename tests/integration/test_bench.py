"""Bench: prompt suites, metrics, cost model, baseline cache, summary; jobs and sweeps against
real engine servers (local; vLLM in the slow tests)."""

import csv
import functools
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from engine_helpers import AGREE_PROMPTS, AGREE_TOKENS
from mlflow.tracking import MlflowClient
from support import QUICK, REPO, VLLM_PYTHON, export_untrained_drafter, run_sweep

from eagle3.bench.app import job_identity
from eagle3.bench.baseline import BaselineIdentity
from eagle3.bench.client import tokenize_prompts
from eagle3.bench.costmodel import StepCost, accept_length, fit_step_cost, predict
from eagle3.bench.measurement import aggregate, percentile
from eagle3.bench.sweep import cost_model_rows, summarize
from eagle3.core.common import Eagle3Error
from eagle3.data.suites import load_suite
from eagle3.tools.results import main as results_main
from eagle3.tools.totals import totals


def identity_of(cfg):
    return job_identity(cfg.bench, cfg.serve, cfg.target, cfg.spec)


def baseline_output(cfg, scope=None):
    return BaselineIdentity(cfg.serve, cfg.bench, cfg.target, cfg.paths.artifacts).output(scope)


# ---------------------------------------------------------------- suites


@pytest.mark.parametrize(
    "suite,count,first",
    [
        ("vicuna", 80, "How can I improve my time management skills?"),
        ("humaneval", 164, "from typing import List"),
        ("gsm8k", 100, "Melanie is a door-to-door saleswoman."),
    ],
)
def test_shipped_suites(make_cfg, suite, count, first):
    prompts = load_suite(make_cfg(f"bench.suite={suite}", "bench.limit=null").bench)
    assert len(prompts) == count and len({p.id for p in prompts}) == count
    assert prompts[0].messages[0]["role"] == "user" and prompts[0].messages[0][
        "content"
    ].startswith(first)
    limited = load_suite(make_cfg(f"bench.suite={suite}", "bench.limit=3").bench)
    assert limited == prompts[:3]


def test_user_jsonl_prompt_and_messages(make_cfg, tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"prompt": "Say hi."},
        {
            "id": "chat",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    prompts = load_suite(make_cfg(f"bench.prompts={path}", "bench.limit=null").bench)
    assert [p.messages for p in prompts] == [
        [{"role": "user", "content": "Say hi."}],
        rows[1]["messages"],
    ]
    assert prompts[1].id == "chat"
    path.write_text(json.dumps({"text": "no prompt field"}) + "\n")
    with pytest.raises(Eagle3Error, match="no string field `prompt`"):
        load_suite(make_cfg(f"bench.prompts={path}").bench)
    with pytest.raises(Eagle3Error, match="does not exist"):
        load_suite(make_cfg(f"bench.prompts={tmp_path}/missing.jsonl").bench)
    with pytest.raises(Eagle3Error, match="unknown bench.suite"):
        load_suite(make_cfg("bench.suite=mtbench").bench)


def test_prompts_are_chat_templated_ids(tiny_target, make_cfg):
    prompts = load_suite(make_cfg("bench.limit=2").bench)
    ids = tokenize_prompts(tiny_target.tokenizer, prompts)
    expected = tiny_target.tokenizer.apply_chat_template(
        prompts[0].messages, add_generation_prompt=True
    )
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ids[0] == list(expected) and all(isinstance(t, int) for t in ids[1])
    assert tiny_target.tokenizer.decode(ids[0]).rstrip().endswith("assistant")


# ---------------------------------------------------------------- metrics


def test_percentile_matches_linear_interpolation():
    values = [4.0, 1.0, 3.0, 2.0]
    assert (
        percentile(values, 50) == 2.5
        and percentile(values, 0) == 1.0
        and percentile(values, 100) == 4.0
    )
    assert percentile(values, 90) == pytest.approx(3.7) and percentile([], 50) is None


def test_aggregate_exact():
    records = [
        {"output_tokens": 11, "ttft_s": 0.1, "latency_s": 1.1, "tok_per_s": 10.0},
        {"output_tokens": 21, "ttft_s": 0.3, "latency_s": 2.3, "tok_per_s": 21 / 2.3},
    ]
    m = aggregate(
        records, wall_s=3.2, acceptance={"accept_length": 2.5, "accept_per_pos": [0.9, 0.6]}
    )
    assert m["tokens_per_s"] == 32 / 3.2 and m["output_tokens"] == 32 and m["requests"] == 2
    assert m["decode_tokens_per_s"] == pytest.approx(
        30 / 3.0
    )  # tokens after the first / decode time
    assert m["step_s"] == pytest.approx(2.5 / 10.0)  # tau / decode rate
    assert m["ttft_p50_ms"] == pytest.approx(200) and m["itl_p50_ms"] == pytest.approx(100)
    assert m["accept_per_pos"] == [0.9, 0.6] and m["accept_length"] == 2.5


# ---------------------------------------------------------------- cost model


def test_cost_model_recovers_line_and_predicts():
    truth = StepCost(verify_s=0.02, draft_step_s=0.004)
    cost = fit_step_cost([(d, truth.step_s(d)) for d in (1, 4, 8)])
    assert cost.verify_s == pytest.approx(0.02) and cost.draft_step_s == pytest.approx(0.004)
    assert fit_step_cost([(4, 0.1), (4, 0.2)]) is None  # one depth: no slope
    per_pos = [0.8, 0.6, 0.4, 0.2]
    assert accept_length(per_pos, 3) == pytest.approx(2.4) and accept_length(per_pos, 6) is None
    pred = predict(per_pos, truth, [1, 3, 5, 9])
    assert pred == {
        1: pytest.approx(1 / 0.02),
        3: pytest.approx(2.4 / 0.028),
        5: pytest.approx(3.0 / 0.036),
    }


def ok_result(depth, tok_s, tau, step_s, per_pos, **extra):
    base = {
        "engine": "local",
        "suite": "vicuna",
        "batch_size": 1,
        "max_new_tokens": 64,
        "status": "ok",
        "spec": f"d{depth}",
        "depth": depth,
        "steps": depth - 1,
        "topk": 1,
        "tokens_per_s": tok_s,
        "baseline_tokens_per_s": 50.0,
        "baseline_step_s": 0.02,
        "speedup": tok_s / 50.0,
        "accept_length": tau,
        "step_s": step_s,
        "decode_tokens_per_s": tau / step_s,
        "accept_per_pos": per_pos,
        "ttft_p50_ms": 30.0,
        "itl_p50_ms": 10.0,
    }
    return {**base, **extra}


def test_cost_model_rows_predict_unmeasured_depths():
    truth = StepCost(0.02, 0.004)
    per_pos = [0.8, 0.6, 0.4, 0.2, 0.1, 0.05, 0.02]
    results = [
        ok_result(8, 90.0, accept_length(per_pos, 8), truth.step_s(8), per_pos),
        ok_result(4, 80.0, accept_length(per_pos, 4), truth.step_s(4), per_pos[:3]),
    ]
    rows = {r["depth"]: r for r in cost_model_rows(results, [2, 6, 12])}
    assert sorted(rows) == [2, 4, 6, 8]  # 12 is past the measured positions
    assert rows[6]["predicted_tok_s"] == pytest.approx(
        accept_length(per_pos, 6) / truth.step_s(6), abs=0.01
    )
    assert rows[6]["measured_tok_s"] == "" and rows[8]["measured_tok_s"] == pytest.approx(
        rows[8]["predicted_tok_s"], abs=0.01
    )


# ---------------------------------------------------------------- summary and baseline cache


def test_summary_lists_failed_jobs_and_best(make_cfg, tmp_path, capsys):
    per_pos = [0.8, 0.5, 0.3]
    results = [
        ok_result(4, 95.0, 2.6, 0.028, per_pos),
        ok_result(3, 80.0, 2.3, 0.024, per_pos[:2]),
        {
            **identity_of(make_cfg("serve=vllm", "spec=d10s5")),
            "status": "failed",
            "error": "Eagle3Error: spec d10s5k4 (topk=4) is a tree; vLLM drafts chains only",
        },
    ]
    out = summarize(make_cfg().bench, results, tmp_path)
    assert out["best"]["spec"] == "d4"
    rows = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert [(r["engine"], r["spec"], r["status"]) for r in rows] == [
        ("local", "d4", "ok"),
        ("local", "d3", "ok"),
        ("vllm", "d10s5k4", "failed"),
    ]
    assert "vLLM drafts chains only" in rows[2]["error"] and float(
        rows[0]["speedup"]
    ) == pytest.approx(1.9)
    assert (tmp_path / "summary.md").read_text().count("\n") == 2 + 3
    for plot in ("tokens_per_s.png", "speedup.png", "accept_length.png"):
        assert (tmp_path / plot).read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "winner: d4 at 1.90x spec=off" in printed and "1 of 3 jobs failed" in printed


def test_baseline_key_shared_across_specs_not_across_batch_sizes(make_cfg):
    a = baseline_output(make_cfg("target=tiny-llama", "spec.depth=16"))
    assert (
        a.hash
        == baseline_output(make_cfg("target=tiny-llama", "spec=d10s5", "serve.port=1234")).hash
    )
    for change in (
        "bench.batch_size=4",
        "bench.max_new_tokens=7",
        "serve=vllm",
        "bench.suite=gsm8k",
        "target=smollm2-135m",
    ):
        assert baseline_output(make_cfg("target=tiny-llama", change)).hash != a.hash, change
    assert a.path.parent.name == "bench_baseline"


# ---------------------------------------------------------------- real engines

# vLLM's CPU attention supports head_dim 32, 64, ...; tiny-llama's default 4 heads of 16 is refused
# ("Unsupported CPU attention configuration: head_dim=16"), so the vLLM tests use 2 heads of 32.
VLLM_TINY = ("target=tiny-llama", "target.num_heads=2", "target.num_kv_heads=1")


def sweep_runs(tmp_path) -> tuple:
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("eagle3").experiment_id])
    parents = [r for r in runs if r.data.tags.get("stage") == "bench-sweep"]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    return client, parents[0], sorted(children, key=lambda r: r.info.start_time)


@pytest.fixture(scope="session")
def vllm_drafter(test_root):
    from eagle3.core.common import compose

    cfg = compose([f"paths.root={test_root}", *VLLM_TINY])
    return export_untrained_drafter(cfg, test_root / "drafters" / "tiny-hd32-untrained")


@pytest.mark.slow
def test_vllm_sweep_reads_counters_and_refuses_trees(
    test_root, tmp_path, vllm_drafter, make_cfg, empty_store
):
    """`python -m eagle3.bench -m serve=vllm spec.depth=4,8` against a real vLLM (CPU), plus a
    tree job that vLLM cannot run: failed before launch, the sweep goes on, the summary lists it."""
    assert VLLM_PYTHON.exists(), "run `make vllm` (tools/setup_vllm.sh) to build .venv-vllm"
    out, sweep_dir = run_sweep(
        test_root,
        tmp_path,
        "serve=vllm",
        "spec=default,d10s5",
        "spec.depth=4,8",
        *VLLM_TINY,
        *QUICK,
        f"drafter.path={vllm_drafter}",
        "bench.min_repeats=3",  # every pass runs: the passes are counted below
        empty_store=empty_store,
    )
    assert out.returncode == 1 and "2 of 4 bench jobs failed" in out.stderr, out.stderr[-3000:]
    results = [json.loads((sweep_dir / str(i) / "bench_result.json").read_text()) for i in range(4)]
    ok = [r for r in results if r["status"] == "ok"]
    failed = [r for r in results if r["status"] == "failed"]
    assert sorted(r["depth"] for r in ok) == [4, 8] and len(failed) == 2
    # d10s5 is a tree (topk 4): refused for vLLM before anything was launched
    assert all(
        "vLLM drafts chains only" in r["error"] and not (Path(r["folder"]) / "spec").exists()
        for r in failed
    )
    for r in ok:
        passes = json.loads((Path(r["folder"]) / "spec" / "requests.json").read_text())
        assert len(passes) == r["repeats"] == 3 and all(len(p) == 3 for p in passes)
        assert r["output_tokens"] == sum(q["output_tokens"] for q in passes[0])
        assert r["num_drafts"] > 0 and len(r["accept_per_pos"]) == r["depth"] - 1  # vLLM's counters
        assert r["accept_length"] == pytest.approx(1 + sum(r["accept_per_pos"]))
        assert r["baseline_tokens_per_s"] == ok[0]["baseline_tokens_per_s"]  # measured once, reused
        assert "--speculative-config" in (Path(r["folder"]) / "spec" / "command.json").read_text()
    assert ok[1]["baseline_run_id"] == ok[0]["run_id"] and not ok[1]["baseline_reused"]
    client, parent, children = sweep_runs(tmp_path)
    assert [c.info.status for c in children] == ["FINISHED", "FINISHED", "FAILED", "FAILED"]
    assert children[0].data.metrics["accept_pos_0"] == ok[0]["accept_per_pos"][0]
    assert {
        "summary.md",
        "summary.csv",
        "tokens_per_s.png",
        "accept_length.png",
        "cost_model.md",
    } <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert parent.info.status == "FINISHED" and parent.data.tags["failed_jobs"] == "2"
    assert (
        "vllm, vicuna, batch 1, 24 new tokens, drafter " in out.stdout
        and "2 of 4 jobs failed" in out.stdout
    )
    assert out.stdout.strip().splitlines()[-1].startswith("cost model: ")


# ---------------------------------------------------------------- the local engine


LOCAL_TINY = ("target=tiny-llama", "serve=local")


def test_local_sweep_one_job_refused(test_root, tmp_path, tiny_drafter, empty_store):
    """`python -m eagle3.bench -m serve=local,vllm spec=d10s5`: the local job runs the tree through
    our server; vLLM refuses the tree: failed, listed, the sweep finishes and exits 1 naming the
    failed job and its error."""
    out, sweep_dir = run_sweep(
        test_root,
        tmp_path,
        "serve=local,vllm",
        "spec=d10s5",
        "target=tiny-llama",
        *QUICK,
        "bench.repeats=1",
        f"drafter.path={tiny_drafter}",
        empty_store=empty_store,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    report = out.stderr[out.stderr.index("eagle3 error: ") :].splitlines()
    assert report[0] == "eagle3 error: 1 of 2 bench jobs failed; the summary lists them"
    assert report[1].startswith(
        "  job 1 (vllm d10s5k4 bs1): Eagle3Error: spec d10s5k4 (topk=4) is a tree"
    )
    local, vllm = (
        json.loads((sweep_dir / str(i) / "bench_result.json").read_text()) for i in range(2)
    )
    assert local["status"] == "ok", local.get("error")
    assert vllm["status"] == "failed" and "vLLM drafts chains only" in vllm["error"]
    assert local["output_tokens"] > 0 and local["accept_length"] >= 1.0 and local["speedup"] > 0
    assert local["ttft_p50_ms"] > 0 and local["itl_p50_ms"] > 0
    client, parent, children = sweep_runs(tmp_path)
    assert [c.info.status for c in children] == ["FINISHED", "FAILED"]
    assert "failure.txt" in {a.path for a in client.list_artifacts(children[1].info.run_id)}
    assert (
        children[0].data.params["spec.depth"] == "10"
        and children[0].data.metrics["tokens_per_s"] > 0
    )
    assert "\n  d10s5k4: " in out.stdout and "1 of 2 jobs failed" in out.stdout


def test_killed_server_marks_the_job_failed(make_cfg, tmp_path, tiny_drafter):
    """A real local server SIGKILLed mid-run: the job is failed (status, log excerpt in its child
    run), no engine process is left, and nothing raises out of run_job."""
    from eagle3.bench.app import run_job

    cfg = make_cfg(
        *LOCAL_TINY,
        "spec.depth=4",
        "bench.limit=4",
        "bench.max_new_tokens=400",
        "bench.ignore_eos=true",
        "bench.repeats=1",
        f"drafter.path={tiny_drafter}",
    )
    folder = tmp_path / "job"
    killed = {}

    def kill_when_serving():
        """SIGKILL the spec server's process group once it has generated tokens (the suite is running)."""
        spec = folder / "spec"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not (spec / "requests.json").exists():
            try:
                port = yaml.safe_load((spec / "engine_config.yaml").read_text())["serve"]["port"]
                stats = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=5).json()
            except (OSError, httpx.HTTPError, TypeError, KeyError):
                stats = {}
            if stats.get("completion_tokens", 0) > 0:
                killed["pid"] = int((spec / "engine.pid").read_text())
                os.killpg(killed["pid"], signal.SIGKILL)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_when_serving)
    killer.start()
    result = run_job(cfg, folder)
    killer.join()
    assert "pid" in killed, "the server finished before it could be killed"
    assert result["status"] == "failed" and "died" in result["error"]
    assert json.loads((folder / "bench_result.json").read_text())["status"] == "failed"
    with pytest.raises(ProcessLookupError):
        os.killpg(killed["pid"], 0)
    run = MlflowClient(tracking_uri=cfg.tracking.uri).get_run(result["run_id"])
    assert run.info.status == "FAILED" and run.data.tags["status"] == "failed"


# ---------------------------------------------------------------- local vs vLLM acceptance


@pytest.mark.slow
def test_local_and_vllm_measure_the_same_tau(make_cfg, tmp_path, shipped_vllm_sweep):
    """Same target weights, same trained drafter (the shipped one), same prompt ids, greedy, a
    depth-4 chain: the local engine's τ and vLLM's τ (from its /metrics counters, the intact job of
    shipped_vllm_sweep) agree within TOLERANCE (see below)."""
    from eagle3.bench.app import run_job

    vllm = shipped_vllm_sweep.results[0]
    local = run_job(
        make_cfg(*SHIPPED_VLLM_JOB, f"drafter.path={shipped_vllm_sweep.intact}", "serve=local"),
        tmp_path / "local",
    )
    assert local["status"] == "ok", local.get("error")
    assert vllm["status"] == "ok", vllm.get("error")
    assert vllm["engine"] == "vllm" and local["drafter_hash"] == vllm["drafter_hash"]
    assert local["output_tokens"] == vllm["output_tokens"] == AGREE_PROMPTS * AGREE_TOKENS
    assert local["accept_length"] > 1.5  # the trained drafter really is accepted
    # TOLERANCE: both engines verify the same chains greedily, so per step they accept the same
    # tokens up to (a) the last step of each request, cut at max_new_tokens (at most one step of
    # depth-1 = 3 drafts per request, counted by one engine and not the other) and (b) a float32
    # argmax flip between vLLM's CPU attention kernel and PyTorch SDPA, rare on a real model's
    # peaked distributions. (a) bounds the difference by 3 drafts * requests / total verify steps;
    # we allow that bound plus 0.05 for (b).
    steps = local["output_tokens"] / local["accept_length"]
    tolerance = 3 * AGREE_PROMPTS / steps + 0.05
    print(
        f"tau local {local['accept_length']:.3f} vllm {vllm['accept_length']:.3f} tolerance {tolerance:.3f}; "
        f"per position local {local['accept_per_pos']} vllm {vllm['accept_per_pos']}"
    )
    assert abs(local["accept_length"] - vllm["accept_length"]) <= tolerance


def test_sweep_without_a_drafter_names_the_command(test_root, tmp_path, empty_store):
    """No drafter trained for this config: every job fails before launching anything, the summary
    lists them, the sweep exits 1 naming the command that makes one."""
    out, sweep_dir = run_sweep(
        test_root,
        tmp_path,
        "spec.depth=16,10",
        "target=tiny-llama",
        "drafter.draft_vocab_size=77",  # a config nothing trained
        empty_store=empty_store,
    )
    assert out.returncode == 1
    assert "all 2 bench jobs failed" in out.stderr and "python -m eagle3.pipeline" in out.stderr
    rows = list(csv.DictReader(open(sweep_dir / "summary.csv")))
    assert [(r["spec"], r["status"]) for r in rows] == [("d16", "failed"), ("d10", "failed")]
    assert not list(sweep_dir.glob("*/baseline")) and not list(sweep_dir.glob("*/spec"))


def test_tree_shapes_predicts_from_gpu_step_costs(tmp_path):
    """benchmarks/tree_shapes.py on engine-loop-shaped files with known costs: GPU steps cost 1.6 ms plus
    0.002 ms per verified node plus a draft step's cost for its top-k (0.13 ms at k=2, 0.10 at k=8,
    0.17 at k=16); a shape's prediction is its τ (summed over suites) over that step time, and a shape
    whose top-k no GPU row has gets none."""

    def row(suite, method, steps, tau, draft_ms, all_in_ms):
        return {
            "suite": suite,
            "method": method,
            "tokens": tau * steps,
            "verify_steps": steps,
            "wall_s": steps * all_in_ms / 1e3,
            "draft_ms_per_step": draft_ms,
            "verify_ms_per_step": 1.4,
        }

    draft_step_ms = {2: 0.13, 8: 0.10, 16: 0.17}

    def step_ms(depth, steps, k):
        return 1.6 + 0.002 * depth + draft_step_ms[k] * steps

    gpu = [row("a", "off", 1000, 1.0, 0.02, 1.4)] + [
        row(
            "a",
            f"d{depth}s{steps}k{k}",
            400,
            2.5,
            draft_step_ms[k] * steps,
            step_ms(depth, steps, k),
        )
        for depth, steps, k in ((6, 3, 2), (8, 4, 2), (32, 4, 8), (24, 3, 8), (64, 5, 16))
    ]
    taus = [
        row("a", "d16s4k8", 300, 3.0, 0, 1),
        row("b", "d16s4k8", 100, 2.0, 0, 1),
        row("a", "d24s6k8", 200, 3.5, 0, 1),
        row("a", "d8s4k2", 50, 2.0, 0, 1),
        row("a", "d16s4k4", 50, 3.0, 0, 1),
    ]
    for name, rows in (("gpu", gpu), ("tau", taus)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"rows": rows}))
    script = REPO / "benchmarks" / "tree_shapes.py"
    run = subprocess.run(
        [
            sys.executable,
            str(script),
            "--tau",
            str(tmp_path / "tau.json"),
            "--gpu",
            str(tmp_path / "gpu.json"),
            "--json",
            str(tmp_path / "out.json"),
            "--plot",
            str(tmp_path / "shapes.png"),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    assert "d16s4k4: no --gpu row with top-k 4" in run.stdout
    assert (tmp_path / "shapes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["base_s"] == pytest.approx(1.6e-3) and out["per_node_s"] == pytest.approx(0.002e-3)
    assert out["per_step_s"] == {str(k): pytest.approx(ms / 1e3) for k, ms in draft_step_ms.items()}
    predicted = {r["spec"]: r for r in out["rows"]}
    assert sorted(predicted) == ["d16s4k8", "d24s6k8", "d8s4k2"]
    assert predicted["d16s4k8"]["tau"] == pytest.approx(2.75)  # (900 + 200) tokens / 400 steps
    assert predicted["d16s4k8"]["predicted_tok_per_s"] == pytest.approx(
        2.75 / (step_ms(16, 4, 8) / 1e3)
    )
    assert predicted["d24s6k8"]["predicted_speedup"] == pytest.approx(3.5 / step_ms(24, 6, 8) * 1.4)
    assert predicted["d24s6k8"]["tau_for_target"] == pytest.approx(2.5 * step_ms(24, 6, 8) / 1.4)
    assert predicted["d8s4k2"]["gpu_tok_per_s"] == pytest.approx(2.5 / (step_ms(8, 4, 2) / 1e3))
    assert "gpu_tau" not in predicted["d24s6k8"]


def test_totals_sum_the_suites_of_each_method(tmp_path, capsys):
    """python -m eagle3.tools.results totals over two engine-loop-shaped files: tok/s is the sum of tokens over the sum of
    wall time (not the mean of the suites' rates), τ and the step over the summed verify steps, the phase
    times weighted by steps (prefill by prompts), the ratio against off's totals; a method measured twice
    on one suite is refused."""

    def row(suite, method, tokens, wall, steps, draft, prompts=4):
        return {
            "suite": suite,
            "method": method,
            "prompts": prompts,
            "tokens": tokens,
            "wall_s": wall,
            "verify_steps": steps,
            "draft_ms_per_step": draft,
            "verify_ms_per_step": 1.0,
            "prefill_ms_per_prompt": 2.0 if suite == "a" else 4.0,
        }

    first = [
        row("a", "off", 100, 1.0, 100, 0.0),
        row("b", "off", 300, 2.0, 300, 0.0),
        row("a", "d8", 100, 0.25, 25, 0.2),
        row("b", "d8", 300, 0.5, 50, 0.5, prompts=12),
    ]
    second = [row("a", "d16", 90, 0.5, 30, 0.3)]
    for name, rows in (("first", first), ("second", second)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"rows": rows}))
    results_main(
        [
            "totals",
            str(tmp_path / "first.json"),
            str(tmp_path / "second.json"),
            "--json",
            str(tmp_path / "totals.json"),
        ]
    )
    printed = capsys.readouterr().out
    out = {t["method"]: t for t in json.loads((tmp_path / "totals.json").read_text())}
    assert list(out) == ["off", "d8", "d16"]
    assert out["off"]["tok_per_s"] == pytest.approx(400 / 3.0) and out["d8"][
        "tok_per_s"
    ] == pytest.approx(400 / 0.75)
    assert out["d8"]["speedup"] == pytest.approx((400 / 0.75) / (400 / 3.0))
    assert "speedup" not in out["d16"]  # one suite of two: not comparable with off's totals
    assert out["d8"]["tau"] == pytest.approx(400 / 75) and out["d8"]["step_ms"] == pytest.approx(
        1000 * 0.75 / 75
    )
    assert out["d8"]["draft_ms_per_step"] == pytest.approx((0.2 * 25 + 0.5 * 50) / 75)
    assert out["d8"]["prefill_ms_per_prompt"] == pytest.approx((2.0 * 4 + 4.0 * 12) / 16)
    assert "d8:    533.3 tok/s (4.000x off)" in printed
    with pytest.raises(SystemExit, match=re.escape("d8: suite measured twice (['a', 'b', 'b'])")):
        totals(first + [row("b", "d8", 1, 1.0, 1, 0.1)])


def test_trace_phases_groups_kernels_by_graph_replay(tmp_path):
    """benchmarks/trace_phases.py on a profiler trace of known shape: two replays of a 3-kernel graph,
    one of a 2-kernel graph, a kernel launched outside any graph (left out) and a graph launch whose
    kernels were not recorded (left out); busy sums kernel time, span runs first start to last end."""

    def kernel(correlation, ts, dur, name="k"):
        return {
            "cat": "kernel",
            "name": name,
            "ts": ts,
            "dur": dur,
            "args": {"correlation": correlation},
        }

    def launch(correlation):
        return {
            "cat": "cuda_runtime",
            "name": "cudaGraphLaunch",
            "args": {"correlation": correlation},
        }

    events = [
        launch(1),
        kernel(1, 10, 2),
        kernel(1, 14, 3),
        kernel(1, 20, 1),
        launch(2),
        kernel(2, 100, 4),
        kernel(2, 106, 2),
        kernel(2, 111, 1),
        launch(3),
        kernel(3, 200, 5),
        {"cat": "gpu_memset", "name": "Memset", "ts": 207, "dur": 1, "args": {"correlation": 3}},
        kernel(4, 300, 50),
        launch(5),
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    script = REPO / "benchmarks" / "trace_phases.py"
    out = subprocess.run(
        [sys.executable, str(script), str(path), "--kernels", "2"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert out[0].split() == ["2", "kernels", "x1", "busy", "6.0", "µs", "span", "8.0", "µs"]
    assert out[1].split() == ["3", "kernels", "x2", "busy", "6.5", "µs", "span", "11.5", "µs"]
    assert out[2] == "-- a replay of 2 kernels"
    assert [line.split() for line in out[3:]] == [["0.0", "5.0", "k"], ["7.0", "1.0", "Memset"]]
    every = subprocess.run(
        [sys.executable, str(script), str(path), "--all"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert (
        every[:2] == out[:2]
        and every.count("-- a replay of 3 kernels") == 1
        and len(every) == 2 + 3 + 4
    )


# ---------------------------------------------------------------- an export the engine ignores


def ignored_layer_copy(drafter: Path, out: Path) -> Path:
    """A copy of an exported drafter as an engine serves it when it ignores the decoder layer's
    weights (the seed's failure: SGLang skipping names it does not know): every midlayer.* tensor at
    a fresh initialisation (norm weights 1, matrices normal(0, 0.02), seed 0), the rest as exported.
    vLLM raises on a weight name it does not know, so it cannot be made to skip them by name: the
    fault is written into the copy, and the engine, target and bench that meet it are real."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    shutil.copy(drafter / "config.json", out / "config.json")
    tensors = load_file(drafter / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, tensor in tensors.items():
        if name.startswith("midlayer."):
            fresh = torch.ones_like(tensor) if tensor.dim() == 1 else torch.empty_like(tensor)
            if tensor.dim() > 1:
                fresh.normal_(0.0, 0.02, generator=generator)
            tensors[name] = fresh
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


# SmolLM2 in float32 (vLLM's and PyTorch's kernels then differ by float32 rounding only), depth-4
# chains, greedy, a fixed length on AGREE_PROMPTS prompts, one pass and no warm-up request (greedy:
# every pass accepts the same tokens, and acceptance is read as counter differences around the
# pass): the settings of the one vLLM sweep below and of the local job it is compared with.
SHIPPED_VLLM_JOB = (
    "target=smollm2-135m",
    "target.dtype=float32",
    "spec.depth=4",
    f"bench.limit={AGREE_PROMPTS}",
    f"bench.max_new_tokens={AGREE_TOKENS}",
    "bench.ignore_eos=true",
    "bench.repeats=1",
    "bench.warmup=0",
)


@dataclass
class ShippedVllmSweep:
    """`python -m eagle3.bench -m serve=vllm drafter.path=INTACT,BROKEN` (SHIPPED_VLLM_JOB) and what
    it wrote: the shipped drafter's export and its ignored_layer_copy, swept through real vLLM (CPU)."""

    folder: Path  # holds sweep/ and mlruns/
    intact: Path
    broken: Path
    results: list[dict]  # bench_result.json of job 0 (intact) and job 1 (broken)


@pytest.fixture(scope="module")
def shipped_vllm_sweep(test_root, tmp_path_factory, empty_store) -> ShippedVllmSweep:
    """One vLLM sweep read by the τ agreement test and the broken-export test (each vLLM server
    start costs ~40 s on CPU)."""
    from eagle3.export.shipped import unpack

    assert VLLM_PYTHON.exists(), "run `make vllm` (tools/setup_vllm.sh) to build .venv-vllm"
    folder = tmp_path_factory.mktemp("shipped-vllm")
    intact = unpack(REPO / "assets" / "drafter-4f658d4f4df1.tgz", folder / "shipped") / "sglang"
    broken = ignored_layer_copy(intact, folder / "ignored")
    out, sweep_dir = run_sweep(
        test_root,
        folder,
        "serve=vllm",
        *SHIPPED_VLLM_JOB,
        f"drafter.path={intact},{broken}",
        empty_store=empty_store,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads((sweep_dir / str(i) / "bench_result.json").read_text()) for i in range(2)]
    return ShippedVllmSweep(folder, intact, broken, results)


@pytest.mark.slow
def test_vllm_serving_a_drafter_whose_layer_it_ignores_is_caught(shipped_vllm_sweep):
    """The shipped drafter and a copy of it whose decoder layer the engine ignores
    (ignored_layer_copy), swept through real vLLM (CPU) on SmolLM2 (shipped_vllm_sweep): the intact
    one is accepted, the broken one gets tau ~1; the verdict says in words to check the export for
    it alone, and only its MLflow run carries the tag."""
    broken = shipped_vllm_sweep.broken
    sweep_dir = shipped_vllm_sweep.folder / "sweep"
    results = shipped_vllm_sweep.results
    assert [r["status"] for r in results] == ["ok", "ok"]
    good, bad = results
    print(
        f"vLLM tau: shipped {good['accept_length']:.3f}, layer ignored {bad['accept_length']:.3f}"
    )
    assert good["output_tokens"] == bad["output_tokens"] == AGREE_PROMPTS * AGREE_TOKENS
    assert good["accept_length"] > 1.5 and bad["accept_length"] < 1.1
    verdict = (sweep_dir / "verdict.txt").read_text()
    assert verdict.count("the engine accepts almost nothing: check the export") == 1
    assert f"check the export (d4 tau {bad['accept_length']:.2f}, under 1.1)" in verdict
    assert verdict.index(f"drafter {Path(broken).name}") < verdict.index("accepts almost nothing")
    _, _, children = sweep_runs(shipped_vllm_sweep.folder)
    tags = {c.info.run_id: c.data.tags.get("acceptance") for c in children}
    assert tags == {
        good["run_id"]: None,
        bad["run_id"]: "the engine accepts almost nothing: check the export",
    }


def test_spreads_apart_by_more_than_their_width():
    from eagle3.bench.verdict import Spread

    off = Spread(10.0, 9.0, 11.0)  # width 2
    assert Spread(14.5, 14.0, 15.0).apart(off)  # 14 - 11 = 3 > 2
    assert Spread(5.5, 5.0, 6.0).apart(off)
    assert not Spread(13.5, 13.0, 14.0).apart(off)  # 2 is not more than the width
    assert not Spread(30.0, 12.0, 40.0).apart(off)  # a wide range: width 28
    assert not Spread(10.0, 9.5, 10.5).apart(off)


@pytest.mark.parametrize("min_repeats, passes", [(2, 2), (3, 3)])
def test_passes_stop_once_apart_from_spec_off(make_cfg, tmp_path, min_repeats, passes):
    """The in-process engine on tiny-llama, 3 repeats against a spec=off spread it cannot reach
    (1e9 tok/s): after bench.min_repeats passes the ranges are apart and the job stops there."""
    from transformers import AutoTokenizer

    from eagle3.bench.engines import open_engine
    from eagle3.bench.measurement import measure
    from eagle3.bench.verdict import Spread
    from eagle3.core.spec import OFF
    from eagle3.core.target import load_target, resolve_target_path
    from eagle3.serve import inprocess
    from eagle3.serve.launch import engine_setup

    cfg = make_cfg(
        "target=tiny-llama",
        "serve.inprocess=true",
        "engine.cpu_threads=1",
        "bench.limit=1",
        "bench.max_new_tokens=4",
        "bench.warmup=0",
        "bench.repeats=3",
        f"bench.min_repeats={min_repeats}",
    )
    path = resolve_target_path(cfg.target, cfg.paths.artifacts)
    requests = tokenize_prompts(AutoTokenizer.from_pretrained(path), load_suite(cfg.bench))
    try:
        opener = functools.partial(
            open_engine, engine_setup(cfg), functools.partial(load_target, cfg), path
        )
        against = Spread(1e9, 1e9, 1e9)
        result = measure(
            opener, cfg.bench, cfg.serve.engine, requests, OFF, None, tmp_path, against
        )
    finally:
        inprocess.release()
    assert result["repeats"] == passes and len(result["tokens_per_s_runs"]) == passes
    assert len(json.loads((tmp_path / "requests.json").read_text())) == passes


def test_sweep_progress_counts_jobs_and_estimates_what_is_left(tmp_path):
    import os
    import re
    import time

    from omegaconf import OmegaConf

    from eagle3.bench.sweep import job_count, progress_line

    grid = OmegaConf.create(
        {"sweeper": {}, "overrides": {"task": ["spec=d4,d8", "bench.batch_size=1,4,8", "seed=1"]}}
    )
    assert job_count(grid) == 6
    assert (
        job_count(OmegaConf.create({"sweeper": {"n_trials": 10}, "overrides": {"task": []}})) == 10
    )
    (tmp_path / "bench_jobs.json").write_text(json.dumps({"jobs": job_count(grid)}))
    for job in ("0", "1"):
        (tmp_path / job / ".hydra").mkdir(parents=True)
        (tmp_path / job / ".hydra" / "config.yaml").write_text("")
    assert progress_line(tmp_path) == "bench job 1 of 6"
    (tmp_path / "0" / "bench_result.json").write_text("{}")
    started = time.time() - 100
    os.utime(tmp_path / "0" / ".hydra" / "config.yaml", (started, started))
    line = progress_line(tmp_path)
    assert re.fullmatch(r"bench job 2 of 6; 1 done in 10[01] s, about 50[0-5] s left", line), line


# ---------------------------------------------------------------- checks before anything heavy


def refused_job(make_cfg, tmp_path, *overrides) -> dict:
    from eagle3.bench.app import run_job

    result = run_job(make_cfg("spec=off", *overrides), tmp_path / "job")
    assert result["status"] == "failed"
    return result


def test_bench_settings_and_prompts_are_checked_before_the_target_is_prepared(make_cfg, tmp_path):
    """A target folder that does not exist would fail its preparation (the conversion a real
    target takes 40 s for): a missing bench.prompts and bench.repeats=0 are named instead."""
    missing = tmp_path / "missing.jsonl"
    nowhere = ("target=hf", f"target.path={tmp_path / 'no-model'}")
    result = refused_job(make_cfg, tmp_path, *nowhere, f"bench.prompts={missing}")
    assert result["error"] == (
        f"Eagle3Error: bench.prompts={missing} does not exist (a JSONL with `prompt` or `messages`)"
    )
    result = refused_job(make_cfg, tmp_path, *nowhere, "bench.repeats=0")
    assert result["error"] == "Eagle3Error: bench.repeats=0: must be an integer >= 1"


def test_prompts_and_completions_beyond_the_engine_context_are_refused_before_it_is_built(
    make_cfg, tmp_path
):
    """engine.max_context below a prompt plus bench.max_new_tokens, or bench.max_new_tokens beyond
    the context: the job fails naming the prompt or the setting, and no engine folder exists."""
    tiny = ("target=tiny-llama", "bench.limit=4", "bench.warmup=0", "bench.repeats=1")
    result = refused_job(
        make_cfg, tmp_path, *tiny, "engine.max_context=40", "bench.max_new_tokens=8"
    )
    assert re.fullmatch(
        r"Eagle3Error: prompt \S+ of \S+ has \d+ tokens: with bench.max_new_tokens=8 it does not "
        r"fit the local engine's context of 40 tokens \(engine.max_context\); lower "
        r"bench.max_new_tokens, raise engine.max_context, or set bench.limit to leave it out",
        result["error"],
    ), result["error"]
    assert not (tmp_path / "job" / "baseline").exists()
    result = refused_job(
        make_cfg,
        tmp_path,
        *tiny,
        "serve=vllm",
        "serve.max_model_len=1024",
        "bench.max_new_tokens=100000",
    )
    assert result["error"] == (
        "Eagle3Error: bench.max_new_tokens=100000 does not fit the vllm engine's context of 1,024 "
        "tokens (serve.max_model_len), prompt and completion together: ask for fewer tokens"
    )
    assert not (tmp_path / "job" / "baseline").exists()


def test_a_sweep_whose_prompts_overflow_the_context_stops_at_once_with_one_line(
    test_root, tmp_path, empty_store
):
    """The context check runs before the first job's run and engine: the sweep exits 1 with one
    error line, and no job measured anything or opened a child run."""
    out, sweep_dir = run_sweep(
        test_root,
        tmp_path,
        "spec=off,d4",
        "target=tiny-llama",
        "engine.max_context=40",
        *QUICK,
        empty_store=empty_store,
    )
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if line.startswith("eagle3 error:")]
    assert len(errors) == 1 and "engine.max_context" in errors[0], out.stderr[-2000:]
    assert not list(sweep_dir.glob("*/bench_result.json"))
    client, parent, children = sweep_runs(tmp_path)
    assert children == []
