"""The spec=off measurement a job's speedup is against: measured once per (engine, target, suite,
batch size, max tokens) and sweep, cached like a stage artifact, or with bench.reuse_baseline the
newest earlier one."""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle3.bench.verdict import Spread
from eagle3.core.artifacts import StageOutput, read_json, stage_output
from eagle3.core.common import log
from eagle3.core.config import BenchConfig, ServeConfig, TargetConfig, plain
from eagle3.data.suites import suite_names

# the spec=off measurement's metrics a job carries as baseline_<key>
BASELINE_KEYS = ("tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "step_s")
# serve settings that do not change a measurement: not part of the baseline's identity
BASELINE_IGNORES = (
    "host",
    "port",
    "start_timeout_s",
    "stop_timeout_s",
    "request_timeout_s",
    "watchdog_poll_s",
    "grace_s",
    "disconnect_poll_s",
    "max_tokens_limit",
    "api_key_env",
    "max_depth",
    "error_lines",
)


@dataclass(frozen=True)
class BaselineIdentity:
    """The settings a spec=off measurement is cached under (engine, target, suite, batch size, max
    tokens; not BASELINE_IGNORES) and the artifacts folder its stage outputs live in."""

    serve: ServeConfig
    bench: BenchConfig
    target: TargetConfig
    artifacts: str

    def output(self, scope: str | None = None) -> StageOutput:
        """Where the spec=off measurement lives; `scope` (a sweep folder) keeps each sweep's own
        measurement apart."""
        serve = {k: v for k, v in plain(self.serve).items() if k not in BASELINE_IGNORES}
        bench = {
            k: v
            for k, v in plain(self.bench).items()
            if k not in ("suites", "reuse_baseline", "cost_model_depths", "min_repeats")
        }
        suite = (
            [plain(self.bench.suites.get(name)) for name in suite_names(self.bench)]
            if not self.bench.prompts
            else None
        )
        sections = {
            "serve": serve,
            "target": plain(self.target),
            "bench": bench,
            "suite": suite,
            "machine": platform.node(),
        }
        if scope:
            sections["scope"] = str(scope)
        return stage_output(self.artifacts, "bench_baseline", sections)

    def earlier(self):
        """The newest complete spec=off measurement of these settings from any sweep, or None."""
        wanted = json.loads(json.dumps(self.output().config, default=str))
        found = []
        for manifest_path in Path(self.artifacts, "bench_baseline").glob("*/manifest.json"):
            manifest = read_json(
                manifest_path, f"remove {manifest_path.parent}: the next job measures again"
            )
            config = {k: v for k, v in manifest.get("config", {}).items() if k != "scope"}
            if manifest.get("complete") and config == wanted:
                found.append((manifest.get("measured_at", 0.0), manifest_path.parent, manifest))
        return max(found, key=lambda item: item[0], default=None)


def baseline(
    identity: BaselineIdentity, measure_off: Callable[[Path], dict], folder: Path, scope: str
) -> dict:
    """spec=off for this job: measured once per sweep (`scope`; measure_off(folder) measures), or
    with bench.reuse_baseline the newest earlier measurement, whose run id and age the result then
    carries."""
    if identity.bench.reuse_baseline:
        earlier = identity.earlier()
        if earlier:
            measured_at, path, manifest = earlier
            log.info("reusing the spec=off baseline %s (run %s)", path, manifest.get("run_id"))
            return {
                **json.loads((path / "metrics.json").read_text()),
                "baseline_reused": True,
                "baseline_run_id": manifest.get("run_id"),
                "baseline_age_s": time.time() - measured_at,
            }
    out = identity.output(scope)
    with out.lock():  # jobs of one sweep running at once (a parallel launcher): one measures
        if out.complete:
            manifest = out.manifest()
            return {
                **json.loads((out.path / "metrics.json").read_text()),
                "baseline_reused": False,
                "baseline_run_id": manifest.get("run_id"),
            }
        metrics = measure_off(folder / "baseline")
        out.start()
        (out.path / "metrics.json").write_text(json.dumps(metrics, indent=1))
        run_id = active_run_id()
        counts = {"requests": metrics["requests"], "output_tokens": metrics["output_tokens"]}
        out.finish(counts, run_id=run_id, measured_at=time.time())
    return {**metrics, "baseline_reused": False, "baseline_run_id": run_id}


def active_run_id() -> str | None:
    """The MLflow run this job logs to (None with tracking off)."""
    mlflow = sys.modules.get("mlflow")
    run = mlflow.active_run() if mlflow else None
    return run.info.run_id if run else None


def off_spread(base: dict) -> Spread | None:
    """spec=off's tok/s spread, when measured over more than one pass (one pass has no range)."""
    if base.get("repeats", 1) < 2 or "tokens_per_s_min" not in base:
        return None
    return Spread.from_result(base, "tokens_per_s")


def baseline_of(result: dict) -> dict:
    """A job's spec=off measurement as the verdict reads it."""
    return {
        k.removeprefix("baseline_"): result.get(k) for k in map("baseline_{}".format, BASELINE_KEYS)
    }
