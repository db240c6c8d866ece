"""How a decoder runs: the engine.* settings both decoders take (SpecDecoder, BatchDecoder), with
`auto` already resolved for the device (engine.service builds them from the config)."""

from __future__ import annotations

from dataclasses import dataclass

from eagle3.core.common import Eagle3Error


@dataclass(frozen=True)
class DecoderOptions:
    """max_context: tokens of prompt + completion (None: the target's own limit). seed: the running
    sampling generator's (requests without their own). cuda_graphs: fixed-shape forwards replay CUDA
    graphs (CUDA only). draft_attention: "explicit" (softmax(QK^T)V in the drafter's lean layer) |
    "sdpa". tree_temperature: trees rank their nodes by cumulative log_softmax(drafter logits /
    tree_temperature) (tree.top_children); any value is lossless.

    The batch-1 decoder's (SpecDecoder): fused: greedy steps run as FusedGreedy (static shapes, one
    host read per step, one CUDA graph per phase); False keeps every step on the step-by-step path
    (same tokens). lean: a plain Llama target and the drafter run engine/llama.py's forwards instead
    of HF's and the drafter module's (same numbers). eager_cudnn: cuDNN attention also outside CUDA
    graphs (runners.eager_attention: off by default, it builds a graph per prompt length).
    compile_layers: verify forwards of fixed shape (graphs, fused steps) run the lean target's layers
    torch.compile'd (TargetRunner). compile_draft: the fused steps' draft and extend phases run
    torch.compile'd (FusedGreedy). compile_prefill: the prefill graphs run the lean target's layers
    torch.compile'd too (a compile per prefill width, once per process). prefill_graphs: with
    cuda_graphs, prompt lengths up to each of these widths replay a prefill graph captured at that
    width (the prompt padded; the padding's cache slots lie past the prompt, where nothing attends
    before they are rewritten). overlap_steps: the fused greedy loop enqueues each step before
    reading the last one's result.

    The batched decoder's (BatchDecoder): graph_batch_sizes: with cuda_graphs, greedy steps replay a
    CUDA graph per (batch size, cache width), the batch padded to the first of these that holds it
    (max_batch_size always counts). static_shapes: greedy steps run at those padded shapes without
    graphs (what the graphs compute, eagerly; for tests on CPU). deterministic: the target and the
    drafter run on float64 copies of their weights (batch.float64_copies)."""

    max_context: int | None = None
    seed: int = 0
    cuda_graphs: bool = False
    draft_attention: str = "explicit"
    tree_temperature: float = 1.0
    fused: bool = True
    lean: bool = True
    eager_cudnn: bool = False
    compile_layers: bool = False
    compile_draft: bool = False
    compile_prefill: bool = False
    prefill_graphs: tuple[int, ...] = ()
    overlap_steps: bool = True
    graph_batch_sizes: tuple[int, ...] = ()
    static_shapes: bool = False
    deterministic: bool = False

    def __post_init__(self):
        if self.draft_attention not in ("explicit", "sdpa"):
            raise Eagle3Error(
                f"engine.draft_attention={self.draft_attention!r}: use explicit or sdpa"
            )
        if not self.tree_temperature > 0:
            raise Eagle3Error(
                f"engine.tree_temperature={self.tree_temperature!r}: must be > 0 (1 = the "
                "drafter's own log-probabilities)"
            )
