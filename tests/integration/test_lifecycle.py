"""Nothing left running, nothing shared: real `eagle3.serve` / `eagle3.bench` processes stopped by
SIGINT, SIGTERM, SIGHUP and SIGKILL take their engine servers with them (and the MLflow run is
marked KILLED); two runs started in the same second get separate folders."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from support import TESTS

from eagle3.core.lifecycle import process_alive, process_identity, start_time

# Runs an eagle3 app with Hydra's clock pinned: the fault to show is two runs started in the
# same second, which a real clock produces only by chance.
SAME_SECOND = """
import datetime, faulthandler, runpy, signal, sys
import hydra.core.utils

faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck run's stacks, on request

class Pinned(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2026, 1, 2, 3, 4, 5)

hydra.core.utils.datetime = Pinned
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""
SERVING = re.compile(r"serving .* at (http://\S+);")


def pid_alive(pid: int) -> bool:
    return start_time(pid) is not None


def wait_until(condition, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if condition():
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"{what} after {timeout_s}s")


def app_argv(module: str, *overrides: str, pinned: bool = True) -> list[str]:
    head = [sys.executable, "-c", SAME_SECOND, module] if pinned else [sys.executable, "-m", module]
    return [*head, *overrides]


def common_overrides(artifacts: Path, root: Path) -> list[str]:
    return [
        f"paths.root={root}",
        f"paths.artifacts={artifacts}",
        f"tracking.uri=sqlite:///{root}/mlruns/mlflow.db",
        f"tracking.artifact_location={root}/mlruns/artifacts",
        "target=tiny-llama",
        "engine.cpu_threads=1",
        "serve.drafter_fallback=untrained",
        "serve.stop_timeout_s=10",
    ]


def start_serve(test_root, root, *overrides, pinned: bool = True, sigint_ignored: bool = False):
    """`python -m eagle3.serve` (clock pinned unless told); sigint_ignored: started as a shell
    without job control starts a background job (`cmd &`), with SIGINT ignored."""
    argv = app_argv(
        "eagle3.serve",
        *common_overrides(test_root / "artifacts", root),
        *overrides,
        pinned=pinned,
    )
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=ignore
    )


def serving(proc) -> tuple[str, int]:
    """(url, engine pid) from the serve's "serving" line. The rest of its output is read on in a thread
    (proc.output): a pipe nobody reads fills up and blocks the serve's next write, its stop included."""
    proc.output = []
    for line in proc.stdout:
        proc.output.append(line)
        match = SERVING.search(line)
        if match:
            threading.Thread(target=proc.output.extend, args=(proc.stdout,), daemon=True).start()
            folder = Path(re.search(r"; log (\S+)engine.log", line).group(1))
            return match.group(1), int((folder / "engine.pid").read_text())
    raise AssertionError("serve exited: " + "".join(proc.output[-20:]))


def exit_code(proc, timeout_s: float) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # pinned runs dump every thread's stack (SAME_SECOND)
        time.sleep(2)
        tail = "".join(proc.output[-60:])
        raise AssertionError(
            f"serve still running {timeout_s} s after its signal; its output:\n{tail}"
        ) from None


def test_two_serves_in_the_same_second_stay_apart_and_stop_their_engines(test_root, tmp_path):
    """Same clock second, different specs: each serves its own spec from its own folder; SIGINT and
    SIGHUP of the serve processes stop both engine servers."""
    procs = [start_serve(test_root, tmp_path, f"spec.depth={d}", "spec.topk=1") for d in (3, 5)]
    try:
        served = [serving(p) for p in procs]
        for (url, _), label in zip(served, ("d3", "d5")):
            assert httpx.get(url + "/stats", timeout=30).json()["spec"] == label
        runs = sorted((tmp_path / "outputs").glob("*/*"))
        assert len(runs) == 2 and all(r.name.startswith("03-04-05-") for r in runs)
        for proc, sig in zip(procs, (signal.SIGINT, signal.SIGHUP)):
            proc.send_signal(sig)
        # a serve's stop takes up to serve.stop_timeout_s (10) + a SIGKILL wait (10) + its own teardown;
        # on a loaded 2-core machine two of them at once need more than 30 s
        for proc, (_, engine_pid), code in zip(procs, served, (0, 128 + signal.SIGHUP)):
            assert exit_code(proc, 90) == code
            assert not pid_alive(engine_pid)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_serve_started_with_sigint_ignored_still_stops_on_sigint(test_root, tmp_path):
    """`make test &` or any background job of a script starts its processes with SIGINT ignored,
    and Python keeps it so: a serve's `kill -INT` was lost there and it ran on. The app sets its
    own handler: the serve stops its engine and exits 0, as after a Ctrl-C."""
    proc = start_serve(test_root, tmp_path, "spec=off", pinned=False, sigint_ignored=True)
    try:
        url, engine_pid = serving(proc)
        proc.send_signal(signal.SIGINT)
        assert exit_code(proc, 60) == 0
        assert not pid_alive(engine_pid)
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_serve_takes_its_engine_along(test_root, tmp_path, sig):
    proc = start_serve(test_root, tmp_path, "spec=off", pinned=False)
    try:
        url, engine_pid = serving(proc)
        proc.send_signal(sig)
        code = exit_code(proc, 30)
        assert code == (128 + sig if sig != signal.SIGKILL else -sig)
        # SIGKILL: the watchdog notices within serve.watchdog_poll_s and the engine drains at once
        wait_until(lambda: not pid_alive(engine_pid), 15, "engine server still running")
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
    finally:
        proc.kill()
        proc.wait()


def bench_argv(artifacts, root, *overrides, multirun: bool = False) -> list[str]:
    return app_argv(
        "eagle3.bench",
        *(["-m"] if multirun else []),
        *common_overrides(artifacts, root),
        "bench.suite=vicuna",
        "bench.limit=1",
        "bench.warmup=0",
        "bench.max_new_tokens=4",
        "bench.repeats=1",
        *overrides,
    )


def runs_by_status(root: Path) -> dict[str, list[str]]:
    from mlflow.tracking import MlflowClient

    from eagle3.core.tracking import store_lock

    uri = f"sqlite:///{root}/mlruns/mlflow.db"
    if not (root / "mlruns" / "mlflow.db").exists():
        return {}
    with store_lock(uri):  # a store being created is migrated by its creator alone
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name("eagle3")
    out: dict[str, list[str]] = {}
    for run in client.search_runs([experiment.experiment_id] if experiment else []):
        out.setdefault(run.info.status, []).append(run.info.run_name)
    return out


def engine_pid_of(root: Path) -> int:
    found = []
    wait_until(
        lambda: found.extend(root.glob("outputs/*/*/**/engine.pid")) or found, 240, "no engine"
    )
    pid_file = found[0]
    wait_until(lambda: pid_file.read_text().strip(), 10, "empty pid file")
    return int(pid_file.read_text())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stopped_bench_stops_its_engine_and_its_run_is_killed(own_artifacts, tmp_path, sig):
    root = tmp_path
    argv = bench_argv(own_artifacts, root, "spec.depth=3", "spec.topk=1") + [
        "bench.max_new_tokens=2000",
        "bench.ignore_eos=true",
        "engine.max_context=2048",
    ]
    log = open(tmp_path / "bench.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        engine_pid = engine_pid_of(root)
        wait_until(lambda: runs_by_status(root).get("RUNNING"), 120, "no MLflow run")
        time.sleep(1)
        proc.send_signal(sig)
        proc.wait(60)
        wait_until(lambda: not pid_alive(engine_pid), 20, "engine server still running")
        # SIGKILL: nothing ran in the bench; the run watchdog it started ends its run
        wait_until(lambda: list(runs_by_status(root)) == ["KILLED"], 60, "a run not KILLED")
    finally:
        proc.kill()
        proc.wait()


def test_process_identity_tells_a_live_process_from_a_dead_one():
    assert process_alive(process_identity()) is True
    child = subprocess.Popen([sys.executable, "-c", "import os; print(os.getpid())"])
    child.wait()
    gone = {**process_identity(), "eagle3.pid": str(child.pid)}
    assert process_alive(gone) is False
    assert process_alive({**process_identity(), "eagle3.host": "elsewhere"}) is None
    reused = {**process_identity(), "eagle3.pid_start": "1"}  # same pid, another start time
    assert process_alive(reused) is False


def test_engine_group_dies_when_its_starter_is_killed_outright(tmp_path):
    """EngineProcess (every engine goes through it) with a grandchild; SIGKILL of the starter."""
    starter = f"""
import sys, time
sys.path.insert(0, {str(TESTS)!r})
from support import http_server_launch
from eagle3.serve.launch import EngineProcess, free_port
launch = http_server_launch(free_port("127.0.0.1"), prefix="sleep 300 & echo $! > {tmp_path}/child.pid; ")
launch.stop_timeout_s, launch.watchdog_poll_s = 3, 0.2
engine = EngineProcess(launch, __import__("pathlib").Path({str(tmp_path)!r})).start()
engine.wait_healthy(60)
print(engine.proc.pid, flush=True)
time.sleep(300)
"""
    proc = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    try:
        server = int(proc.stdout.readline())
        child = int((tmp_path / "child.pid").read_text())
        assert pid_alive(server) and pid_alive(child)
        proc.kill()
        proc.wait()
        took = wait_until(
            lambda: not pid_alive(server) and not pid_alive(child), 10, "engine group alive"
        )
        assert took < 4  # poll 0.2 s; http.server and sleep die on SIGTERM
    finally:
        proc.kill()
        proc.wait()


def sweep_results(root: Path) -> list[tuple[str, list[str]]]:
    out = []
    for sweep in sorted((root / "multirun").glob("*/*")):
        specs = [
            json.loads(p.read_text())["spec"] for p in sorted(sweep.glob("*/bench_result.json"))
        ]
        out.append((sweep.name, specs))
    return out


@pytest.mark.slow
def test_two_sweeps_in_the_same_second_stay_apart(own_artifacts, tmp_path):
    """Two `eagle3.bench -m` sweeps with one clock second: separate folders, summaries and
    parent runs, every job in its own sweep (spec=off and one chain each: the chain's job reuses
    its sweep's spec=off measurement, so each sweep starts two engines)."""
    procs = []
    for specs in ("off,d4", "off,d8"):
        argv = bench_argv(
            own_artifacts,
            tmp_path,
            f"spec={specs}",
            "bench.reuse_baseline=false",
            multirun=True,
        )
        log = open(tmp_path / f"sweep-{specs}.log", "w")
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
    for proc in procs:
        assert proc.wait(900) == 0
    results = sweep_results(tmp_path)
    assert [specs for _, specs in results] in (
        [["off", "d4"], ["off", "d8"]],
        [["off", "d8"], ["off", "d4"]],
    )
    assert all(name.startswith("03-04-05-") for name, _ in results)
    for sweep in (tmp_path / "multirun").glob("*/*"):
        assert (sweep / "summary.md").read_text().count("| local |") == 2
    statuses = runs_by_status(tmp_path)
    assert list(statuses) == ["FINISHED"] and len(statuses["FINISHED"]) == 6


def child_pids() -> set[int]:
    return {
        int(pid)
        for task in Path("/proc/self/task").iterdir()
        for pid in (task / "children").read_text().split()
    }


def test_a_spawned_childs_watchdog_is_reaped_when_the_child_ends():
    """spawn() starts the child and its watchdog; once the child has ended, the watchdog exits
    and is waited for (no zombie per engine start until the starter exits)."""
    from eagle3.core.lifecycle import spawn

    before = child_pids()
    proc = spawn([sys.executable, "-c", "pass"], 1.0, 0.05, stdout=subprocess.DEVNULL)
    proc.wait()
    started = child_pids() - before - {proc.pid}
    assert len(started) <= 1  # the watchdog, unless it has already been reaped
    wait_until(lambda: not (child_pids() & started), 20, "the watchdog is still a child")


def settled_runs(root: Path) -> dict[str, list[str]]:
    """runs_by_status, {} while the bench is still creating the store (its schema migrations)."""
    try:
        return runs_by_status(root)
    except Exception:
        return {}


def test_killed_sweep_leaves_no_run_running(own_artifacts, tmp_path):
    """SIGKILL of `eagle3.bench -m` during its job: the sweep's parent run and the job's child run
    are marked KILLED by the watchdog the bench started, with no other process opening the store."""
    argv = bench_argv(own_artifacts, tmp_path, "spec=off", multirun=True)
    argv += ["bench.max_new_tokens=2000", "bench.ignore_eos=true", "engine.max_context=2048"]
    log = open(tmp_path / "bench.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: len(settled_runs(tmp_path).get("RUNNING", [])) == 2, 240, "no runs")
        proc.kill()
        proc.wait(60)
        wait_until(
            lambda: list(runs_by_status(tmp_path)) == ["KILLED"],
            30,
            f"runs left {runs_by_status(tmp_path)}",
        )
        assert len(runs_by_status(tmp_path)["KILLED"]) == 2
    finally:
        proc.kill()
        proc.wait()
