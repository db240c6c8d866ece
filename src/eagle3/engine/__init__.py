"""The embedded speculative decoder: draft trees, tree verification, KV caches, sampling,
acceptance measurement and an HTTP server (`python -m eagle3.engine.server`)."""

from eagle3.engine.decoder import ContextOverflow, GenerationResult, RequestStats, SpecDecoder
from eagle3.engine.evaluate import measure_acceptance, summarize

__all__ = [
    "ContextOverflow",
    "GenerationResult",
    "RequestStats",
    "SpecDecoder",
    "measure_acceptance",
    "summarize",
]
