"""Loaded by the vLLM server that `extract.backend=vllm` starts (it runs in vLLM's own interpreter
and imports nothing else from eagle3): vLLM's hidden-state KV connector, made to run on a CPU
worker as well.

vLLM's `extract_hidden_states` speculative method stores the target's aux hidden states of every
prompt token in a cache-only attention layer's KV cache (on every tensor-parallel rank: the
residual stream is replicated), and `ExampleHiddenStatesConnector` copies them out on rank 0 and
saves one safetensors file per request ({"hidden_states" [T, k, H], "token_ids" [T]}), guarded by
an exclusive flock on `<file>.lock` until the write is done. Its copy goes through a CUDA stream
into pinned memory, which fails on a CPU worker ("pin_memory=True requires a CUDA or other
accelerator backend"); this subclass copies with a plain clone there and keeps everything else,
the lock protocol included. On CUDA it is the stock connector.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event of a copy that has already happened (host tensors)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is not None and self._kv_cache.device.type == "cuda":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (
            torch.arange(self._block_size).reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size
        ).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(
            self._write_tensors, tensors, done, pending.filename, lock_fd
        )
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
