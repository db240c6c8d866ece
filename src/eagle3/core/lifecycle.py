"""Every process eagle3 starts dies with its starter.

- `raise_on_signals()`: SIGTERM and SIGHUP raise `Stopped` in the main thread and SIGINT raises
  KeyboardInterrupt, also where the process was started with SIGINT ignored (a shell without job
  control starts background jobs so), so `finally` blocks stop engines and MLflow marks the run KILLED.
- `spawn()`: a child in its own process group plus a watchdog (eagle3/core/group_reaper.py) that ends the
  group when the starter dies without cleaning up (SIGKILL, OOM killer): bounded by the
  watchdog's poll interval plus the child's grace period. The watchdog exits with the group and
  is waited for by a thread (no zombie left per engine start).
- `watch_runs()`: a watchdog (eagle3/core/mlflow_run_reaper.py) that marks the MLflow runs of this process
  KILLED when the process is killed outright (the runs a stage or a sweep left RUNNING).
- `process_identity()` / `process_alive()`: pid + start time, so a run left RUNNING by a killed
  process can be recognised later (the pid alone may have been reused).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
REAPER = Path(__file__).with_name("group_reaper.py")
RUN_REAPER = Path(__file__).with_name("mlflow_run_reaper.py")
_RUN_WATCHDOGS: dict[tuple[str, str], subprocess.Popen] = {}
# The environment variable that hands a started engine server its launch token: its /health
# answers with it, so a health check proves it reached the engine this process started.
LAUNCH_TOKEN_ENV = "EAGLE3_LAUNCH_TOKEN"


class Stopped(BaseException):
    """The process received SIGTERM or SIGHUP (a BaseException, like KeyboardInterrupt, so that
    `except Exception` blocks do not swallow it)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_stopped(signum, _frame):
    raise Stopped(signum)


def raise_on_signals() -> None:
    """SIGTERM/SIGHUP raise Stopped, SIGINT KeyboardInterrupt (main thread only; elsewhere Python
    cannot set handlers). Python leaves SIGINT ignored when it starts with it ignored (`cmd &` in a
    script): a Ctrl-C or `kill -INT` sent to the app would then be lost, so it is set here too."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _raise_stopped)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def spawn(argv: list[str], grace_s: float, poll_s: float, **popen_kwargs) -> subprocess.Popen:
    """Popen with setsid (start_new_session: its own process group) and a watchdog that SIGTERMs
    the group as soon as this process is gone, and SIGKILLs it grace_s later."""
    proc = subprocess.Popen(argv, start_new_session=True, **popen_kwargs)
    proc.watchdog = subprocess.Popen(
        [
            sys.executable,
            "-s",
            str(REAPER),
            str(os.getpid()),
            str(proc.pid),
            str(grace_s),
            str(poll_s),
        ],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    reap_in_background(proc.watchdog)
    return proc


def reap_in_background(proc: subprocess.Popen) -> None:
    """Wait for `proc` in a daemon thread, so that its exit status is collected as soon as it ends."""
    threading.Thread(target=proc.wait, daemon=True, name=f"reap-{proc.pid}").start()


def watch_runs(uri: str, experiment_id: str, poll_s: float) -> None:
    """Once per (store, experiment) and process: start eagle3/core/mlflow_run_reaper.py, which marks this
    process's runs still RUNNING there KILLED as soon as the process is gone without having
    stopped it (it is stopped at a normal exit, when every run has been closed)."""
    if (uri, experiment_id) in _RUN_WATCHDOGS:
        return
    identity = process_identity()
    argv = [sys.executable, "-s", str(RUN_REAPER), identity["eagle3.pid"]]
    argv += [identity["eagle3.pid_start"], str(poll_s), identity["eagle3.host"], uri, experiment_id]
    watchdog = subprocess.Popen(
        argv,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    watchdog.started_by = os.getpid()
    _RUN_WATCHDOGS[(uri, experiment_id)] = watchdog
    reap_in_background(watchdog)


@atexit.register
def _stop_run_watchdogs() -> None:
    """At a normal exit of the process that started them (not of a forked child)."""
    for watchdog in _RUN_WATCHDOGS.values():
        if watchdog.started_by == os.getpid() and watchdog.poll() is None:
            watchdog.kill()


def run_child(argv: list[str], grace_s: float, poll_s: float, **popen_kwargs) -> int:
    """spawn() and wait; if this process is interrupted meanwhile (Ctrl-C, Stopped), the child's
    group gets SIGTERM and, grace_s later, SIGKILL. Returns the child's exit status."""
    proc = spawn(argv, grace_s, poll_s, **popen_kwargs)
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:
            stop_group(proc, grace_s)


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the child's process group, SIGKILL it after grace_s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def process_identity() -> dict[str, str]:
    """This process as MLflow tags: host, pid and the pid's start time."""
    return {
        "eagle3.host": socket.gethostname(),
        "eagle3.pid": str(os.getpid()),
        "eagle3.pid_start": str(start_time(os.getpid())),
    }


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else int(fields[19])


def process_alive(identity: dict[str, str]) -> bool | None:
    """Whether the process named by process_identity() tags still runs: None when it ran on
    another host (or the tags are missing)."""
    if identity.get("eagle3.host") != socket.gethostname() or "eagle3.pid" not in identity:
        return None
    started = start_time(int(identity["eagle3.pid"]))
    return started is not None and str(started) == identity.get("eagle3.pid_start")
