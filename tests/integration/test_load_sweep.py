"""A real local sweep over bench.batch_size=1,4 (eagle3.bench.concurrency) that batches rather than
queues, and writes the load summary and the schedule for both batch sizes."""

from __future__ import annotations

import json
import re

import pytest
from support import QUICK, run_sweep


@pytest.mark.slow
def test_local_sweep_over_batch_sizes_batches(test_root, tmp_path, tiny_drafter, empty_store):
    """`python -m eagle3.bench -m spec=off,d4 bench.batch_size=1,4 serve=local`: the engine batches
    bench.batch_size requests (spec=off's total tok/s at batch 4 above batch 1's), and the
    sweep writes load.md and the schedule for both batch sizes."""
    out, sweep_dir = run_sweep(
        test_root,
        tmp_path,
        "spec=off,d4",
        "bench.batch_size=1,4",
        "serve=local",
        "target=tiny-llama",
        "engine.cpu_threads=1",
        *QUICK,
        "bench.limit=8",
        f"drafter.path={tiny_drafter}",
        empty_store=empty_store,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = [json.loads(p.read_text()) for p in sweep_dir.glob("*/bench_result.json")]
    assert all(j["status"] == "ok" for j in jobs), [j.get("error") for j in jobs]
    for j in jobs:  # provenance on every row
        assert j["dtype"] == "float32" and j["temperature"] == 0.0
        assert j["drafter_hash"] or j["spec"] == "off"
        assert j["hardware"] and j["engine_version"].startswith("eagle3") and j["torch_version"]
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", j["git_commit"])
    off = {j["batch_size"]: j["tokens_per_s"] for j in jobs if j["spec"] == "off"}
    # tiny-llama's steps cost little next to HTTP and host work; a queue would stay at batch 1's rate
    assert off[4] > 1.1 * off[1], off
    (plan,) = json.loads((sweep_dir / "schedule.json").read_text())
    assert [e["batch_size"] for e in plan["entries"]] == [1, 4]
    # where it was measured: a schedule runs only there
    assert (plan["hardware"], plan["engine_version"]) == (jobs[0]["hardware"], "eagle3 0.1.0")
    assert "## Step cost per batch size" in (sweep_dir / "load.md").read_text()
