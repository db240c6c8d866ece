"""Where and how a job was measured: the machine, the engine and its version, torch, dtype,
temperature and git commit, and the drafter's export hash."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch
import transformers

from eagle3.core.artifacts import git_commit, read_json
from eagle3.core.common import hardware, local_engine_version
from eagle3.core.config import BenchConfig, ServeConfig, TargetConfig
from eagle3.serve.launch import engine_python

# what every result row carries about where and how it was measured (besides drafter_hash)
PROVENANCE = ("hardware", "engine_version", "torch_version", "dtype", "temperature", "git_commit")


def provenance(serve: ServeConfig, target: TargetConfig, bench: BenchConfig) -> dict:
    """The machine, engine and its version, torch, dtype, sampling temperature and git commit of a
    measured job. dtype: the target's as configured for the local engine (auto = bfloat16 on a GPU,
    float32 on a CPU), serve.dtype for vLLM and SGLang."""
    dtype = target.dtype if serve.engine in ("local", "hf") else serve.dtype
    if dtype == "auto":
        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    return {
        "hardware": hardware(),
        "engine_version": engine_version(serve),
        "torch_version": torch.__version__,
        "dtype": str(dtype),
        "temperature": float(bench.temperature),
        "git_commit": git_commit(),
    }


def drafter_hash(path) -> str | None:
    """The export hash of a drafter folder (its manifest, or the parent export's), else its name."""
    if not path:
        return None
    for folder in (Path(path), Path(path).parent):
        manifest = folder / "manifest.json"
        if manifest.exists():
            return read_json(manifest, "export the drafter again").get("hash") or folder.name
    return Path(path).name


def engine_version(serve: ServeConfig) -> str:
    """The serving engine's package version (read from its own interpreter, in the environment the
    engine starts with (serve.env), for vLLM / SGLang)."""
    if serve.engine == "local":
        return local_engine_version()
    if serve.engine == "hf":
        return f"transformers {transformers.__version__}"
    code = (
        "import importlib.metadata as m\n"
        f"for name in ('{serve.engine}', '{serve.engine}-cpu'):\n"
        "    try: print(m.version(name)); break\n"
        "    except m.PackageNotFoundError: pass"
    )
    try:
        env = {**os.environ, **{k: str(v) for k, v in serve.env.items()}}
        done = subprocess.run(
            [engine_python(serve), "-c", code], capture_output=True, text=True, timeout=60, env=env
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return f"{serve.engine} {done.stdout.strip() or 'unknown'}"
