"""Secrets never reach a log, an MLflow param or a saved config.

A value is secret when its key matches *token*, *key*, *secret* or *password* (any case) and it
is text (counts such as `max_new_tokens: 128` stay visible), or when it is a value of an
environment mapping handed to a process (`serve.env.DATABASE_URL`): those keep their names only,
whatever they are called. Keys ending in `_env` name an environment variable, not its value
(`serve.api_key_env: EAGLE3_API_KEY`), and stay visible. The password of a URL
(`postgres://bob:***@db`) is masked in every string. Command lines are masked too:
`--api-key X`, `--hf-token=X`, `serve.env.ANY_NAME=X`.
The `MaskSecrets` Hydra callback rewrites Hydra's own saved files (.hydra/config.yaml,
hydra.yaml, overrides.yaml, multirun.yaml) masked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from eagle3.core.config import Config, plain

MASK = "***"
SECRET_NAME = re.compile(r"token|key|secret|passw", re.IGNORECASE)
ENV_SECTIONS = ("env", "env_set", "environ")


def secret_name(name: str) -> bool:
    name = str(name).lstrip("-+~").split(".")[-1]
    return bool(SECRET_NAME.search(name)) and not name.lower().endswith("_env")


def is_secret(name: str, value: Any, in_env: bool = False) -> bool:
    if in_env:
        return value is not None
    if isinstance(value, bool) or not secret_name(name):
        return False
    return isinstance(value, str)


ASSIGNMENT = re.compile(r"(?<![\w-])([\w.+~]*?(?:token|key|secret|passw)\w*)=([^,\s]+)", re.I)
ENV_ASSIGNMENT = re.compile(
    r"(?<![\w-])([\w.+~]*?\b(?:" + "|".join(ENV_SECTIONS) + r")\.[^=,\s]+)=([^,\s]+)"
)
URL_PASSWORD = re.compile(r"(\b[a-z][\w+.-]*://[^\s:/@]*:)[^\s@/]+(@)", re.I)
FLAG = re.compile(r"(--[\w-]*(?:token|key|secret|passw)[\w-]*)(=|,|\s+)([^\s,\]]+)", re.I)


def mask_text(text: str) -> str:
    """`a.hf_token=X`, `serve.env.NAME=X`, `--api-key X`, `--api-key=X` and a URL's password inside a
    string, masked (numbers stay, except environment values)."""

    def assignment(match: re.Match) -> str:
        name, value = match.group(1), match.group(2)
        in_env = ".env." in name
        if name.lower().endswith("_env") or (value.isdigit() and not in_env):
            return match.group(0)
        return f"{name}={MASK}"

    text = ENV_ASSIGNMENT.sub(lambda m: f"{m.group(1)}={MASK}", text)
    text = URL_PASSWORD.sub(lambda m: f"{m.group(1)}{MASK}{m.group(2)}", text)
    text = ASSIGNMENT.sub(assignment, text)
    return FLAG.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)


def mask(tree: Any, in_env: bool = False) -> Any:
    """A copy of a plain config tree (dicts, lists, scalars) with secret values masked."""
    if isinstance(tree, dict):
        return {
            key: MASK if is_secret(key, value, in_env) else mask(value, str(key) in ENV_SECTIONS)
            for key, value in tree.items()
        }
    if isinstance(tree, list):
        return mask_argv(tree) if all(isinstance(v, str) for v in tree) else [mask(v) for v in tree]
    return mask_text(tree) if isinstance(tree, str) else tree


def mask_argv(argv: list[str]) -> list[str]:
    """A command line or override list with secret values masked (`--api-key X`, `a.key=X`)."""
    out, hide_next = [], False
    for arg in argv:
        if hide_next:
            out.append(MASK)
            hide_next = False
        else:
            out.append(mask_text(arg))
            hide_next = arg.startswith("--") and "=" not in arg and secret_name(arg)
    return out


def masked_config(cfg: Config) -> dict:
    """The resolved config as plain data, secrets masked."""
    return mask(plain(cfg))


def mask_yaml_file(path: Path) -> None:
    """Rewrite a saved YAML config (a mapping or an override list) with its secrets masked."""
    if not path.exists():
        return
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(mask(data))))


class MaskSecrets(Callback):
    """Hydra writes .hydra/*.yaml (and a sweep's multirun.yaml) before the app runs: mask them."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        output_subdir = config.hydra.output_subdir
        if output_subdir is None:
            return
        folder = Path(config.hydra.runtime.output_dir) / output_subdir
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
            mask_yaml_file(folder / name)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        mask_yaml_file(Path(config.hydra.sweep.dir) / "multirun.yaml")
