"""One forward of the target (verify) and of the drafter (a draft step), eager or replayed
from CUDA graphs captured per query length over static buffers.

Both runners take bool masks [q, kv_len] (True = attend); `kv_len(needed)` tells the
decoder how wide to build them: just what is needed when eager, the whole cache when
replaying a graph (graphs need fixed shapes).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from eagle3.core.target import Target, aux_capture
from eagle3.engine.kv import DrafterKV, TargetKV
from eagle3.engine.llama import LeanDrafter, LeanLlama


class Graphed:
    """A function of tensors captured once as a CUDA graph; calls copy inputs and replay."""

    def __init__(self, fn, inputs: list[torch.Tensor], pool):
        self.inputs = [x.clone() for x in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(*self.inputs)

    def __call__(self, *args):
        for buffer, value in zip(self.inputs, args):
            buffer.copy_(value)
        self.graph.replay()
        return self.outputs


def eager_attention(cudnn: bool):
    """The sdpa backends of forwards run outside a CUDA graph (prefill, odd shapes). cuDNN's fused
    attention builds a graph for every new input shape, and every prompt length is one; inside a
    CUDA graph the shapes are fixed, so the captured steps keep torch's default choice."""
    if cudnn:
        return nullcontext()
    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    )


class TargetRunner:
    def __init__(
        self,
        target: Target,
        max_len: int,
        lean: bool = True,
        eager_cudnn: bool = False,
        compile_layers: bool = False,
    ):
        """lean: run a plain Llama target through LeanLlama (same numbers, fewer kernels);
        other targets, or lean=False, run HF's forward. eager_cudnn: allow cuDNN attention
        outside CUDA graphs (see eager_attention). compile_layers: the verify graphs run LeanLlama's
        layers torch.compile'd, as do FusedGreedy's verify phases (fixed shapes); prefills do not."""
        self.target = target
        self.model = target.model
        self.dtype = next(self.model.parameters()).dtype
        self.device = target.device
        self.kv = TargetKV(self.model.config, max_len, self.dtype, self.device)
        self.lean = LeanLlama(target, max_len) if lean and LeanLlama.supports(self.model) else None
        self.eager_cudnn, self.compile_layers = eager_cudnn, compile_layers
        self.graphs: dict[int, Graphed] = {}

    def kv_len(self, needed: int) -> int:
        return self.kv.max_len if self.graphs else needed

    def forward(self, ids, positions, slots, mask):
        """ids/positions/slots [q], mask bool [q, kv_len] -> (logits float [q, V], aux [q, 3H])."""
        graph = self.graphs.get(ids.numel())
        if graph is not None:
            return graph(ids, positions, slots, mask)
        with eager_attention(self.eager_cudnn):
            return self._forward(ids, positions, slots, mask)

    def _forward(self, ids, positions, slots, mask, compiled: bool = False):
        self.kv.prepare(slots, mask.shape[-1])
        if self.lean is not None:
            return self.lean.forward(ids, positions, self.kv, mask, compiled=compiled)
        additive = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device)
        additive = additive.masked_fill(~mask, torch.finfo(self.dtype).min)[None, None]
        with aux_capture(self.model, self.target.aux_layer_ids) as captured:
            out = self.model.model(
                input_ids=ids[None],
                attention_mask=additive,
                position_ids=positions[None],
                past_key_values=self.kv,
                use_cache=True,
            )
        return self.model.lm_head(out.last_hidden_state[0]).float(), captured[-1][0]

    def capture(self, lengths: list[int], pool, compiled: bool = False) -> None:
        for q in sorted(set(lengths)):
            example = [
                torch.zeros(q, dtype=torch.long, device=self.device),
                torch.zeros(q, dtype=torch.long, device=self.device),
                torch.arange(q, device=self.device),
                torch.ones(q, self.kv.max_len, dtype=torch.bool, device=self.device),
            ]
            self.graphs[q] = Graphed(lambda *a: self._forward(*a, compiled=compiled), example, pool)


class DrafterRunner:
    def __init__(
        self,
        drafter,
        max_len: int,
        lean: bool = True,
        eager_cudnn: bool = False,
        explicit_attention: bool = False,
    ):
        """lean: the drafter's step through LeanDrafter (same numbers, fewer kernels);
        eager_cudnn as TargetRunner's; explicit_attention: LeanDrafter's softmax(QK^T)V."""
        self.drafter = drafter
        self.dtype = drafter.fc.weight.dtype
        self.device = drafter.fc.weight.device
        self.kv = DrafterKV(drafter.config, max_len, self.dtype, self.device)
        self.lean = (
            LeanDrafter(drafter, max_len, explicit_attention)
            if lean and LeanDrafter.supports(drafter)
            else None
        )
        self.eager_cudnn = eager_cudnn
        self.graphs: dict[int, Graphed] = {}

    def kv_len(self, needed: int) -> int:
        return self.kv.max_len if self.graphs else needed

    def step(self, ids, hidden, positions, slots, mask):
        """A drafting step from the drafter's own hidden states [q, H] -> (hidden [q, H], logits [q, Vd])."""
        return self._run("step", ids, hidden, positions, slots, mask)

    def extend(self, ids, aux, positions, slots, mask):
        """Committed tokens with the target's aux states [q, 3H_target] -> (hidden, logits)."""
        return self._run("extend", ids, aux, positions, slots, mask)

    def _run(self, kind, ids, states, positions, slots, mask):
        graph = self.graphs.get((kind, ids.numel()))
        if graph is not None:
            return graph(ids, states, positions, slots, mask)
        with eager_attention(self.eager_cudnn):
            return self._forward(kind, ids, states, positions, slots, mask)

    def _forward(self, kind, ids, states, positions, slots, mask):
        states = states.to(self.dtype)
        hidden = self.drafter.project(states) if kind == "extend" else states
        if self.lean is not None:
            self.kv.prepare(slots, mask.shape[-1])
            out = self.lean.forward(ids, hidden, positions, self.kv, mask)
            return out, self.lean.logits(out)
        self.kv.prepare(slots, mask.shape[-1], mask[None, None])
        out = self.drafter(ids[None], hidden[None], positions[None], self.kv.attend)[0]
        return out, self.drafter.logits(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of drafter hidden states [q, H]."""
        return (self.lean or self.drafter).logits(hidden)

    def capture(self, shapes: list[tuple[str, int]], pool) -> None:
        config = self.drafter.config
        for kind, q in sorted(set(shapes)):
            width = 3 * config.target_hidden_size if kind == "extend" else config.hidden_size
            example = [
                torch.zeros(q, dtype=torch.long, device=self.device),
                torch.zeros(q, width, dtype=self.dtype, device=self.device),
                torch.zeros(q, dtype=torch.long, device=self.device),
                torch.arange(q, device=self.device),
                torch.ones(q, self.kv.max_len, dtype=torch.bool, device=self.device),
            ]
            self.graphs[(kind, q)] = Graphed(lambda *a, k=kind: self._forward(k, *a), example, pool)
