"""Deploy an engine (local | vllm | sglang) behind one interface: compose, start, wait healthy,
read stats, stop.

Every engine is a real process in its own process group, bound to 127.0.0.1 on a free port,
its output captured to a log file in the job folder, and stopped (the whole group) on exit,
error, Ctrl-C, SIGTERM and SIGHUP; a watchdog ends the group when its starter is killed outright
(eagle3.lifecycle). `python -m eagle3.serve` runs the configured engine in the foreground.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from omegaconf import DictConfig, OmegaConf

from eagle3.common import CONF_DIR, Eagle3Error, api_key, app, log
from eagle3.lifecycle import spawn
from eagle3.outputs import resolve_drafter_path, serving_folder
from eagle3.redact import mask, mask_argv, mask_text, masked_config
from eagle3.shipped import shipped_drafter, wanted
from eagle3.spec import Spec, resolve_spec
from eagle3.target import resolve_target_path

ENGINES = ("local", "vllm", "sglang")
VLLM_SPEC_METRICS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
_LIVE: set[EngineProcess] = set()


class EngineFailed(Eagle3Error):
    """An engine that did not start, timed out or died; carries the end of its log."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


# ---------------------------------------------------------------- validating a spec per engine


def check_spec_for_engine(engine: str, spec: Spec, max_depth: int | None = None) -> None:
    """Refuse, before launching anything, a spec the engine cannot run (names the rule)."""
    if engine not in ENGINES:
        raise Eagle3Error(f"unknown serve.engine {engine!r}: use one of {', '.join(ENGINES)}")
    if max_depth is not None and spec.enabled and spec.depth > max_depth:
        raise Eagle3Error(
            f"spec.depth={spec.depth} exceeds serve.max_depth={max_depth} (tokens verified per step)"
        )
    if engine == "vllm" and spec.enabled and spec.topk > 1:
        raise Eagle3Error(
            f"spec {spec.label} (topk={spec.topk}) is a tree; vLLM drafts chains only "
            "(num_speculative_tokens): use spec.topk=1 with serve=vllm, or serve=local/sglang"
        )


# ---------------------------------------------------------------- composing commands


@dataclass
class Launch:
    """Everything needed to start one engine process."""

    engine: str
    argv: list[str]
    env: dict[str, str] = field(repr=False)  # may hold secrets (command.json masks them)
    host: str
    port: int
    health_path: str = "/health"
    files: dict[str, str] = field(
        default_factory=dict
    )  # name -> text, written next to the log first
    stop_timeout_s: float = 30.0  # serve.stop_timeout_s: SIGTERM to SIGKILL
    watchdog_poll_s: float = 0.5  # serve.watchdog_poll_s: how often the watchdog checks its starter
    api_key: str | None = field(default=None, repr=False)  # clients send it (serve.api_key_env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def engine_python(scfg) -> str:
    """serve.python; a relative path is taken from the eagle3 checkout (where `make setup` puts the venvs)."""
    path = Path(str(scfg.python)).expanduser()
    return str(path if path.is_absolute() else Path(CONF_DIR).parent / path)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def compose_launch(
    cfg: DictConfig,
    spec: Spec,
    drafter_path: Path | None,
    target_path: Path | str,
    port: int | None = None,
) -> Launch:
    """The command that serves `cfg.target` (+ the drafter when spec is enabled) on `cfg.serve.engine`."""
    scfg = cfg.serve
    check_spec_for_engine(scfg.engine, spec, scfg.get("max_depth"))
    if spec.enabled and drafter_path is None and not untrained_fallback(cfg):
        raise Eagle3Error(f"spec {spec.label} needs a drafter; set drafter.path or use spec=off")
    port = port or scfg.port or free_port(scfg.host)
    composer = {"local": local_launch, "vllm": vllm_launch, "sglang": sglang_launch}[scfg.engine]
    launch = composer(cfg, spec, drafter_path, target_path, port)
    launch.stop_timeout_s = scfg.stop_timeout_s
    launch.watchdog_poll_s = scfg.watchdog_poll_s
    launch.api_key = api_key(scfg)
    return launch


def local_launch(cfg, spec, drafter_path, target_path, port) -> Launch:
    """Our server gets the job's exact resolved config as its primary config file (secrets masked:
    the server reads its API key from the environment)."""
    job = masked_config(cfg)
    job["spec"] = {
        "enabled": spec.enabled,
        "depth": spec.depth,
        "steps": spec.steps,
        "topk": spec.topk,
    }
    job["serve"]["port"] = port
    if job["engine"].get("max_batch_size") is None:  # batch as many as the bench keeps in flight
        job["engine"]["max_batch_size"] = cfg.bench.batch_size
    job["drafter"]["path"] = str(drafter_path) if drafter_path else None
    argv = [
        engine_python(cfg.serve) if cfg.serve.python else sys.executable,
        "-m",
        "eagle3.engine.server",
        "--config-path",
        "{folder}",
        "--config-name",
        "engine_config",
        "hydra.run.dir={folder}/hydra",
        "hydra.output_subdir=null",
    ]
    return Launch(
        "local",
        argv,
        {},
        cfg.serve.host,
        port,
        files={"engine_config.yaml": OmegaConf.to_yaml(OmegaConf.create(job))},
    )


def vllm_cli(scfg) -> str:
    """vLLM's own command-line entry point (`vllm serve`), installed beside serve.python."""
    return str(Path(engine_python(scfg)).with_name("vllm"))


def vllm_launch(cfg, spec, drafter_path, target_path, port) -> Launch:
    v = cfg.serve
    argv = [
        vllm_cli(v),
        "serve",
        str(target_path),
        "--host",
        v.host,
        "--port",
        str(port),
        "--dtype",
        v.dtype,
        "--max-model-len",
        str(v.max_model_len),
        "--max-num-seqs",
        str(v.max_num_seqs),
        "--seed",
        str(cfg.seed),
    ]
    if v.enforce_eager:
        argv.append("--enforce-eager")
    if spec.enabled:
        config = {
            "method": "eagle3",
            "model": str(drafter_path),
            "num_speculative_tokens": spec.steps,
        }
        argv += ["--speculative-config", json.dumps(config)]
    argv += [str(a) for a in v.extra_args]
    env = {k: str(val) for k, val in v.env.items()}
    if api_key(v):
        env["VLLM_API_KEY"] = api_key(v)  # by environment: never on a command line
    return Launch("vllm", argv, env, v.host, port)


def sglang_cuda_graph_flag(version: str) -> str:
    """--cuda-graph-max-bs was replaced by --cuda-graph-max-bs-decode in SGLang 0.5.20."""
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
    return "--cuda-graph-max-bs-decode" if parts >= (0, 5, 20) else "--cuda-graph-max-bs"


def sglang_version(scfg) -> str:
    """serve.version, or (auto) the version installed for serve.python."""
    if scfg.version != "auto":
        return str(scfg.version)
    probe = "import importlib.metadata as m; print(m.version('sglang'))"
    try:
        out = subprocess.run(
            [engine_python(scfg), "-c", probe], capture_output=True, text=True, timeout=60
        )
    except OSError as err:
        raise Eagle3Error(
            f"serve.python={scfg.python} cannot run ({err}): run `make sglang` or point "
            "serve.python at an interpreter with sglang"
        ) from err
    if out.returncode != 0:
        raise Eagle3Error(
            f"sglang is not installed for serve.python={scfg.python}; set serve.version explicitly"
        )
    return out.stdout.strip()


def sglang_argv(cfg, spec: Spec, drafter_path, target_path, port) -> list[str]:
    """Arguments of `python -m sglang.launch_server` (also fed to SGLang's own parser in tests)."""
    s = cfg.serve
    argv = [
        "--model-path",
        str(target_path),
        "--host",
        s.host,
        "--port",
        str(port),
        "--tp-size",
        str(s.tp_size),
        "--mem-fraction-static",
        str(s.mem_fraction_static),
        "--dtype",
        s.dtype,
        sglang_cuda_graph_flag(sglang_version(s)),
        str(s.cuda_graph_max_bs),
    ]
    if spec.enabled:
        argv += [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            str(drafter_path),
            "--speculative-num-steps",
            str(spec.steps),
            "--speculative-eagle-topk",
            str(spec.topk),
            "--speculative-num-draft-tokens",
            str(spec.depth),
        ]
    if api_key(s):
        argv += ["--api-key", api_key(s)]  # masked in command.json and the log
    return argv + [str(a) for a in s.extra_args]


SGLANG_PARSE = """
import contextlib, io, json, sys
from sglang.srt.server_args import prepare_server_args
fields = ("model_path", "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
          "speculative_eagle_topk", "speculative_num_draft_tokens", "tp_size", "mem_fraction_static", "dtype", "port")
results = []
for argv in json.loads(sys.argv[1]):
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = prepare_server_args(argv)
        results.append({"parsed": {f: getattr(args, f, None) for f in fields}})
    except (SystemExit, Exception) as err:
        lines = [l for l in errors.getvalue().splitlines() if "error" in l.lower()] or [repr(err)]
        results.append({"error": " ".join(lines)[-500:]})
print(json.dumps(results))
"""


def sglang_parse_many(python: str, argvs: list[list[str]], timeout_s: float = 300) -> list[dict]:
    """Run SGLang's own parser (sglang.srt.server_args.prepare_server_args) on each argv with
    `python` (one interpreter start): per argv {"parsed": fields} or {"error": the parser's complaint}."""
    try:
        out = subprocess.run(
            [python, "-c", SGLANG_PARSE, json.dumps(argvs)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except OSError as err:
        raise Eagle3Error(
            f"cannot run {python} to validate the SGLang command ({err}): run `make sglang`"
        ) from err
    if out.returncode != 0:
        raise Eagle3Error(
            f"cannot import SGLang's argument parser with {python}: {out.stderr.strip()[-500:]}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def sglang_parse(python: str, argv: list[str]) -> dict:
    """The parsed fields of one command, or Eagle3Error naming what SGLang rejects."""
    result = sglang_parse_many(python, [argv])[0]
    if "error" in result:
        raise Eagle3Error(f"SGLang rejects the command {' '.join(argv)}: {result['error']}")
    return result["parsed"]


def sglang_launch(cfg, spec, drafter_path, target_path, port) -> Launch:
    args = sglang_argv(cfg, spec, drafter_path, target_path, port)
    if cfg.serve.validate_args:
        sglang_parse(engine_python(cfg.serve), args)
    argv = [engine_python(cfg.serve), "-m", "sglang.launch_server", *args]
    return Launch(
        "sglang", argv, {k: str(v) for k, v in cfg.serve.env.items()}, cfg.serve.host, port
    )


# ---------------------------------------------------------------- running a process


class EngineProcess:
    """A started engine: `with EngineProcess(launch, folder) as engine: engine.wait_healthy(...)`."""

    def __init__(self, launch: Launch, folder: Path, name: str = "engine"):
        self.launch = launch
        self.folder = Path(folder)
        self.log_path = self.folder / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return self.launch.base_url

    def start(self) -> EngineProcess:
        self.folder.mkdir(parents=True, exist_ok=True)
        for name, text in self.launch.files.items():
            (self.folder / name).write_text(text)
        argv = [a.replace("{folder}", str(self.folder)) for a in self.launch.argv]
        shown = {"argv": mask_argv(argv), "env": mask(self.launch.env, in_env=True)}
        (self.folder / "command.json").write_text(json.dumps(shown, indent=2))
        log.info(
            "starting %s: %s (log %s)", self.launch.engine, " ".join(shown["argv"]), self.log_path
        )
        with open(self.log_path, "ab") as log_file:
            try:
                self.proc = spawn(
                    argv,
                    self.launch.stop_timeout_s,
                    self.launch.watchdog_poll_s,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, **self.launch.env},
                )
            except FileNotFoundError as err:
                hint = {"vllm": "make vllm", "sglang": "make sglang"}.get(
                    self.launch.engine, "make setup"
                )
                raise EngineFailed(
                    f"{argv[0]} not found: run `{hint}` or set serve.python=<an interpreter "
                    f"with {self.launch.engine}>"
                ) from err
        (self.folder / f"{self.log_path.stem}.pid").write_text(str(self.proc.pid))
        _LIVE.add(self)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        url = self.base_url + self.launch.health_path
        while time.monotonic() < deadline:
            if not self.alive():
                raise EngineFailed(
                    f"{self.launch.engine} server exited with code {self.proc.returncode} before "
                    f"becoming healthy (log: {self.log_path})",
                    self.log_tail(),
                )
            try:
                if httpx.get(url, timeout=poll_s * 4).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
        raise EngineFailed(
            f"{self.launch.engine} server not healthy after {timeout_s:.0f}s (log: {self.log_path})",
            self.log_tail(),
        )

    def check_alive(self, grace_s: float = 0.0) -> None:
        """Raise EngineFailed if the server is gone; grace_s waits for a dying one (a dropped
        connection can arrive before its process is reaped)."""
        if grace_s and self.alive():
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        if not self.alive():
            raise EngineFailed(
                f"{self.launch.engine} server died (exit code {self.proc.returncode}; "
                f"log: {self.log_path})",
                self.log_tail(),
            )

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM the process group, SIGKILL it after timeout_s."""
        _LIVE.discard(self)
        if self.proc is None or self.proc.poll() is not None and not _group_alive(self.proc.pid):
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(self.proc.pid):
                break
            time.sleep(min(wait_s, 2))  # children of the group still shutting down
            if not _group_alive(self.proc.pid):
                break

    def log_tail(self, lines: int = 40) -> str:
        """The end of the engine's log, secrets masked (it goes into MLflow tags and errors)."""
        if not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(mask_text(line) for line in tail)

    def __enter__(self) -> EngineProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


@atexit.register
def _stop_all() -> None:
    for engine in list(_LIVE):
        engine.stop(timeout_s=5)


# ---------------------------------------------------------------- reading acceptance counters


def read_counters(engine: str, base_url: str, timeout_s: float = 30, headers=None) -> dict:
    """A snapshot of the engine's cumulative speculative counters (diff two snapshots per job)."""
    if engine == "vllm":
        reply = httpx.get(base_url + "/metrics", timeout=timeout_s, headers=headers)
        return parse_vllm_metrics(reply.text)
    if engine == "local":
        return httpx.get(base_url + "/stats", timeout=timeout_s, headers=headers).json()
    return {}  # SGLang reports acceptance per request (meta_info)


def parse_vllm_metrics(text: str) -> dict:
    """Spec-decode counters from vLLM's Prometheus text, summed over label sets:
    {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos": [...]}."""
    counters = {name: 0.0 for name in VLLM_SPEC_METRICS}
    per_pos: dict[int, float] = {}
    pattern = re.compile(r"^vllm:spec_decode_(\w+?)_total(?:\{(.*)\})?\s+(\S+)")
    for line in text.splitlines():
        match = pattern.match(line)
        if not match:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if name in counters:
            counters[name] += value
        elif name == "num_accepted_tokens_per_pos":
            pos = int(re.search(r'position="(\d+)"', labels).group(1))
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    counters["accepted_per_pos"] = [per_pos[p] for p in sorted(per_pos)]
    return counters


def counter_delta(before: dict, after: dict) -> dict:
    """after - before for numbers and (element-wise, zero-padded) lists."""
    delta = {}
    for key, value in after.items():
        old = before.get(key, 0)
        if isinstance(value, list):
            old = list(old or [])
            old += [0] * (len(value) - len(old))
            delta[key] = [a - b for a, b in zip(value, old)]
        elif isinstance(value, (int, float)):
            delta[key] = value - (old or 0)
    return delta


def acceptance_from_counters(delta: dict) -> dict:
    """tau (tokens per verify step, the bonus token included) and per-position acceptance rates
    from a vLLM-style counter delta."""
    drafts = delta.get("num_drafts", 0)
    if not drafts:
        return {}
    accepted = delta["num_accepted_tokens"]
    return {
        "accept_length": 1 + accepted / drafts,
        "num_drafts": drafts,
        "accept_per_pos": [n / drafts for n in delta.get("accepted_per_pos", [])],
        "draft_acceptance_rate": accepted / max(delta["num_draft_tokens"], 1),
    }


# ---------------------------------------------------------------- the app


def start_engine(
    cfg: DictConfig,
    spec: Spec,
    drafter_path: Path | None,
    target_path,
    folder: Path,
    name: str = "engine",
) -> EngineProcess:
    """Compose, start and wait until healthy; the process is stopped if it never gets there."""
    engine = EngineProcess(
        compose_launch(cfg, spec, drafter_path, target_path), folder, name
    ).start()
    try:
        engine.wait_healthy(cfg.serve.start_timeout_s)
    except BaseException:
        engine.stop(cfg.serve.stop_timeout_s)
        raise
    return engine


def untrained_fallback(cfg: DictConfig) -> bool:
    """serve=local with serve.drafter_fallback=untrained and no drafter.path: the local server
    builds an untrained drafter itself when none was exported for this config."""
    return (
        cfg.serve.engine == "local"
        and cfg.serve.get("drafter_fallback") == "untrained"
        and not cfg.drafter.get("path")
    )


def drafter_for(cfg: DictConfig, spec: Spec) -> Path | None:
    """The exported drafter folder the engine loads (None: spec=off, or the local server's own
    untrained fallback)."""
    if not spec.enabled:
        return None
    # each engine reads custom aux-layer ids in its own convention; local reads any
    if wanted(cfg):
        return serving_folder(shipped_drafter(cfg), cfg.serve.engine)
    try:
        return Path(resolve_drafter_path(cfg, engine=cfg.serve.engine))
    except Eagle3Error:
        if untrained_fallback(cfg):
            return None
        raise


def target_path_for(cfg: DictConfig):
    return resolve_target_path(cfg.target, Path(cfg.paths.artifacts))


@app
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    spec = resolve_spec(cfg.spec)
    check_spec_for_engine(cfg.serve.engine, spec, cfg.serve.get("max_depth"))
    folder = Path(HydraConfig.get().runtime.output_dir)
    engine = start_engine(cfg, spec, drafter_for(cfg, spec), target_path_for(cfg), folder)
    print(
        f"{cfg.serve.engine} serving {cfg.target.name} (spec {spec.label}) at {engine.base_url}; "
        f"log {engine.log_path}; Ctrl-C stops it",
        flush=True,
    )
    try:
        while engine.alive():
            time.sleep(1)
        raise EngineFailed(
            f"{cfg.serve.engine} server exited with code {engine.proc.returncode}",
            engine.log_tail(),
        )
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop(cfg.serve.stop_timeout_s)


if __name__ == "__main__":
    main()
