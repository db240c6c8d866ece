"""Secrets never reach a log, an MLflow param or a saved config.

A value is secret when its key matches *token*, *key*, *secret* or *password* (any case) and it
is text (counts such as `max_new_tokens: 128` stay visible), or when it is a value of an
environment mapping handed to a process (`serve.env.DATABASE_URL`): those keep their names only,
whatever they are called. Keys ending in `_env` name an environment variable, not its value
(`serve.api_key_env: EAGLE3_API_KEY`), and stay visible. The password of a URL
(`postgres://bob:***@db`) is masked in every string, found by parsing the URL: its user info runs
to the last `@` before the host, so a password holding `/`, `@` or `:` is masked whole
(urllib.parse's split would end the user info at a `/`). Command lines are masked too: `--api-key X`, `--hf-token=X`,
`serve.env.ANY_NAME=X`; an override (one argument `key=value`) whose key is secret or names an
environment value has its whole value masked, quotes, commas and spaces included.
The `MaskSecrets` Hydra callback rewrites Hydra's own saved files (.hydra/config.yaml,
hydra.yaml, overrides.yaml, multirun.yaml) masked; `mask_logs()` masks every log record an app writes,
and the apps' one-line errors are masked too.
"""

from __future__ import annotations

import logging
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


# a value inside text: quoted (as Hydra writes one holding a comma or a space), or up to a comma or space
VALUE = r"""('[^']*'|"[^"]*"|(?:\\.|[^,\s\\])+)"""
ASSIGNMENT = re.compile(r"(?<![\w-])([\w.+~]*?(?:token|key|secret|passw)\w*)=" + VALUE, re.I)
ENV_ASSIGNMENT = re.compile(
    r"(?<![\w-])([\w.+~]*?\b(?:" + "|".join(ENV_SECTIONS) + r")\.[^=,\s]+)=" + VALUE
)
# a URL in text: scheme:// up to a space or quote (what urllib.parse reads as one URL); a sweep job's
# saved overrides escape its colons (`http\://bob\:pw@h`)
URL = re.compile(r"\b[a-z][\w+.-]*\\?://[^\s'\"<>]+", re.I)
FLAG = re.compile(r"(--[\w-]*(?:token|key|secret|passw)[\w-]*)(=|,|\s+)([^\s,\]]+)", re.I)
# one override argument: [+~]key=value (Hydra's grammar; the value is everything after the first =)
OVERRIDE = re.compile(r"([+~]{0,2}[\w.-]+(?:@[\w.]+)?)=(.*)", re.S)


def mask_url(url: str) -> str:
    """A URL with its password masked. The user info is what precedes the last `@` of the URL's
    authority and path: a password may hold `/`, `@` or `:` unencoded, and urllib.parse.urlsplit
    would end the user info at the first `/` (leaving the password's rest in the path). Its user
    ends at the first `:`."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    userinfo, _, host = rest.rpartition("@")
    user, colon, password = userinfo.partition(":")
    if not colon or not password or re.search(r"[/?#@]", user):
        return url  # no password, or the `@` is in a path (`git+https://host/repo@v1`)
    return f"{scheme}://{user}:{MASK}@{host}"


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
    text = URL.sub(lambda m: mask_url(m.group(0)), text)
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
            out.append(mask_override(arg))
            hide_next = arg.startswith("--") and "=" not in arg and secret_name(arg)
    return out


def mask_override(arg: str) -> str:
    """One argument: `key=value` with a secret key, or a key inside an environment section, keeps
    its key only (the whole value, whatever it holds); anything else as mask_text masks it."""
    match = OVERRIDE.fullmatch(arg)
    if match and not arg.startswith("-"):
        key, value = match.group(1), match.group(2)
        parts = key.lstrip("+~").split("@")[0].split(".")
        in_env = any(part in ENV_SECTIONS for part in parts[:-1])
        numeric = value.strip().lstrip("-").replace(".", "", 1).isdigit()
        if in_env or (secret_name(key) and not numeric):
            return f"{key}={MASK}"
    return mask_text(arg)


def masked_config(cfg: Config) -> dict:
    """The resolved config as plain data, secrets masked."""
    return mask(plain(cfg))


def mask_yaml_file(path: Path) -> None:
    """Rewrite a saved YAML config (a mapping or an override list) with its secrets masked."""
    if not path.exists():
        return
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(mask(data))))


def mask_logs() -> None:
    """Mask every log record this process makes from now on (mask_text), whichever handler writes it:
    the record factory masks its message as it is made, so Hydra reconfiguring its handlers (the
    launcher does before it logs each job's overrides) keeps it."""
    make = logging.getLogRecordFactory()
    if getattr(make, "masks_secrets", False):
        return

    def masked_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging reports it when the record is written
            return record
        masked = mask_text(message)
        if masked != message:
            record.msg, record.args = masked, None
        return record

    masked_record.masks_secrets = True
    logging.setLogRecordFactory(masked_record)


class MaskSecrets(Callback):
    """Hydra writes .hydra/*.yaml (and a sweep's multirun.yaml) before the app runs: mask them."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.types import RunMode

        if config.hydra.mode == RunMode.MULTIRUN:  # Hydra saves it after on_multirun_start
            mask_yaml_file(Path(config.hydra.sweep.dir) / "multirun.yaml")
        output_subdir = config.hydra.output_subdir
        if output_subdir is None:
            return
        folder = Path(config.hydra.runtime.output_dir) / output_subdir
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
            mask_yaml_file(folder / name)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        mask_logs()  # the launcher logs each job's overrides before the job starts
        mask_yaml_file(Path(config.hydra.sweep.dir) / "multirun.yaml")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        mask_yaml_file(Path(config.hydra.sweep.dir) / "multirun.yaml")
