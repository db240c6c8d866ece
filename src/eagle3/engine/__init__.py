"""The embedded speculative decoder: draft trees, tree verification, KV caches, sampling,
continuous batching and acceptance measurement (its HTTP front is `eagle3.serve.server`).

May import: core."""

from eagle3.engine.decoder import (
    ContextOverflow,
    DecodeRequest,
    GenerationResult,
    RequestStats,
    SpecDecoder,
)
from eagle3.engine.evaluate import measure_acceptance, summarize
from eagle3.engine.options import DecoderOptions

__all__ = [
    "ContextOverflow",
    "DecodeRequest",
    "DecoderOptions",
    "GenerationResult",
    "RequestStats",
    "SpecDecoder",
    "measure_acceptance",
    "summarize",
]
