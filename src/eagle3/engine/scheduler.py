"""Continuous batching behind the server: a thread steps a BatchDecoder while requests are in flight
or waiting; each caller's generate() queues its request and waits for it to finish."""

from __future__ import annotations

import threading

import torch

from eagle3.common import log
from eagle3.engine.batch import BatchDecoder
from eagle3.engine.decoder import GenerationResult


class BatchScheduler:
    """Drop-in for SpecDecoder.generate in the server (same arguments), concurrent callers share steps."""

    concurrent = True  # the server calls generate() from many threads at once

    def __init__(self, decoder: BatchDecoder):
        self.decoder = decoder
        self.spec, self.max_context = decoder.spec, decoder.max_context
        self.wake = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="eagle3-batch", daemon=True)
        self.thread.start()

    def check_prompt(self, prompt_ids: list[int]) -> None:
        self.decoder.check_prompt(prompt_ids)

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_ids=(),
        on_tokens=None,
        generator: torch.Generator | None = None,
    ) -> GenerationResult:
        request = self.decoder.add(
            prompt_ids, max_new_tokens, temperature, top_p, stop_ids, on_tokens, generator
        )
        with self.wake:
            self.wake.notify()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return request.result

    def _loop(self) -> None:
        while True:
            with self.wake:
                self.wake.wait_for(lambda: self.decoder.busy)
            try:
                self.decoder.step()
            except Exception as error:  # noqa: BLE001 -- fail the requests, keep serving
                log.exception("batched step failed; failing the requests in flight")
                self.decoder.fail_all(error)
