"""Continuous batching behind the server: a thread steps a BatchDecoder while requests are in flight
or waiting; each caller's generate() queues its request and waits for it to finish.

A request that finds the engine idle decodes on the fused batch-1 decoder (SpecDecoder: CUDA graphs,
compiled phases), the fastest path for one request. When another request arrives it stops there at
the next step boundary and joins the batch with what it committed (its context prefilled once more,
its last token the next root), so the two share steps from then on.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch

from eagle3.core.common import log
from eagle3.engine.batch_decoder import BatchDecoder, BatchRequest
from eagle3.engine.decoder import DecodeRequest, GenerationResult, SpecDecoder


class BatchScheduler:
    """Drop-in for SpecDecoder.generate in the server (a DecodeRequest), concurrent callers share steps."""

    concurrent = True  # the server calls generate() from many threads at once

    def __init__(self, decoder: BatchDecoder, single: SpecDecoder | None = None):
        """single: the fused batch-1 decoder a request runs on while it is alone (None: always
        the batched steps)."""
        self.decoder, self.single = decoder, single
        self.spec, self.max_context = decoder.spec, decoder.max_context
        self.target, self.tree_temperature = decoder.target, decoder.tree_temperature
        self.alone = 0  # requests that started on the batch-1 decoder
        self.handed_over = 0  # of those, requests that moved into the batch when another arrived
        self.wake = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="eagle3-batch", daemon=True)
        self.thread.start()

    def check_prompt(self, prompt_ids: list[int]) -> None:
        self.decoder.check_prompt(prompt_ids)

    def generate(self, asked: DecodeRequest) -> GenerationResult:
        request = self.decoder.add(asked)
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
            lone = self.decoder.take_lone() if self.single is not None else None
            if lone is not None:
                self._run_alone(lone)
                continue
            try:
                self.decoder.step()
            except Exception as error:  # noqa: BLE001 -- fail the requests, keep serving
                log.exception("batched step failed; failing the requests in flight")
                self.decoder.fail_all(error)

    @torch.inference_mode()
    def _run_alone(self, request: BatchRequest) -> None:
        """Decode a lone request on the batch-1 decoder until it finishes, or until another request
        arrives: then it resumes in the batch from what it committed."""
        self.alone += 1
        own_stop, arrival = [False], [False]

        def on_tokens(new: list[int]) -> bool:
            request.out += new
            if request.asked.on_tokens is not None and BatchDecoder._tell(request, new):
                own_stop[0] = True
            elif request.cancelled:
                own_stop[0] = True
            elif self.decoder.arrivals:
                arrival[0] = True
            return own_stop[0] or arrival[0]

        # the batch's budget and generator: handed over to the batch, the request goes on with both
        alone = dataclasses.replace(
            request.asked,
            max_new_tokens=request.budget,
            on_tokens=on_tokens,
            generator=request.sampling.generator,
        )
        try:
            result = self.single.generate(alone)
        except Exception as error:  # noqa: BLE001 -- this request fails, the engine keeps serving
            log.exception("batch-1 decode failed")
            request.error, request.finish = error, "abort"
            request.result = GenerationResult(list(request.out), "abort", request.stats)
            request.done.set()
            return
        if arrival[0] and not own_stop[0] and len(request.out) < request.budget:
            self.handed_over += 1
            result.stats.draft_tokens = result.stats.verified_drafts
            request.stats = result.stats
            self.decoder.resume(request)
            return
        finish = "abort" if request.cancelled else result.finish_reason
        result.stats.total_time_s = time.perf_counter() - request.started
        request.finish, request.result = (
            finish,
            GenerationResult(result.tokens, finish, result.stats),
        )
        request.done.set()
