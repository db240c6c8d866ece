"""Preallocated KV caches for the target (an HF model) and the drafter.

Both are slot-addressed: before a forward the decoder says which cache slots the new
tokens are written to (`slots`) and how many slots attention reads (`kv_len`); the
attention mask decides which of those slots each query sees. Committed tokens sit at
slot == position; a verified tree sits after them and its accepted path is gathered
back into place (`keep`). Buffers are [batch, kv_heads, max_len, head_dim] so batched
decoding can come later; the decoder uses batch 1.
"""

from __future__ import annotations

import torch

from eagle3.core.drafter import sdpa


class SlotKV:
    """Per-layer K/V buffers written at explicit slots."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        batch: int = 1,
    ):
        # one buffer for all layers' K and V, so moving an accepted path is two copies, not 4 per layer
        self.buffer = torch.zeros(
            (2, num_layers, batch, kv_heads, max_len, head_dim), dtype=dtype, device=device
        )
        self.keys = [self.buffer[0, layer] for layer in range(num_layers)]
        self.values = [self.buffer[1, layer] for layer in range(num_layers)]
        self.max_len = max_len
        self.slots = torch.zeros(1, dtype=torch.long, device=device)
        self.kv_len = max_len

    def prepare(self, slots: torch.Tensor, kv_len: int) -> None:
        """Where the next forward writes, and how many leading slots it reads."""
        self.slots = slots
        self.kv_len = kv_len

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        self.keys[layer].index_copy_(2, self.slots, key.to(self.keys[layer].dtype))
        self.values[layer].index_copy_(2, self.slots, value.to(self.values[layer].dtype))
        return self.keys[layer][:, :, : self.kv_len], self.values[layer][:, :, : self.kv_len]

    def write_pair(self, layer: int, pair: torch.Tensor):
        """write's keys and values stacked [2, batch, kv_heads, q, dim]: one copy for both."""
        self.buffer[:, layer].index_copy_(3, self.slots, pair.to(self.buffer.dtype))
        return self.keys[layer][:, :, : self.kv_len], self.values[layer][:, :, : self.kv_len]

    def keep(self, start, sources: torch.Tensor) -> None:
        """Move the entries at slots `sources` to slots start, start+1, ... (accepted tree path);
        `start` is an int or a device scalar tensor (inside a CUDA graph)."""
        dest = start + torch.arange(sources.numel(), device=sources.device)
        self.buffer.index_copy_(4, dest, self.buffer.index_select(4, sources))


class TargetKV(SlotKV):
    """Passed to an HF decoder as `past_key_values`: its attention layers call `update`."""

    is_compileable = False

    def __init__(self, config, max_len: int, dtype: torch.dtype, device: torch.device):
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        super().__init__(
            config.num_hidden_layers, config.num_key_value_heads, head_dim, max_len, dtype, device
        )

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.write(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len


class DrafterKV(SlotKV):
    """The drafter's cache; `attend` is the callback Eagle3Drafter.forward takes."""

    def __init__(self, config, max_len: int, dtype: torch.dtype, device: torch.device):
        super().__init__(
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            max_len,
            dtype,
            device,
        )
        self.mask = None  # bool [1, 1, q, kv_len], True = attend

    def prepare(self, slots: torch.Tensor, kv_len: int, mask: torch.Tensor | None = None) -> None:
        super().prepare(slots, kv_len)
        self.mask = mask

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.write(layer, k, v)
        return sdpa(q, keys, values, self.mask)
