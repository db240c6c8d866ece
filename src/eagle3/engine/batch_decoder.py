"""Continuous batching: up to engine.max_batch_size requests share each speculative step.

A step is one batched draft phase (the drafter over every request's frontier at once), one
target forward over all requests' trees ([B, depth] tokens, each row its own tree mask and
positions), ragged acceptance (each request commits its own accepted path and bonus token) and
one batched drafter extend over the committed tokens. Requests join between steps: the ones
waiting are prefilled together in one forward before the next step (so a newcomer stalls the
others by one prefill), and leave when they finish; the rows stay packed (the last row moves
into a freed one), so every forward reads a view of the caches. spec=off is the same loop with a
root-only tree. The per-request arithmetic is SpecDecoder's (engine/decoder.py): the same tree,
the same acceptance rules, the same positions; greedy output equals the target's own greedy decode.
A batch of greedy requests steps through BatchGreedySteps (engine/batch_greedy.py: the same step at
fixed shapes, kept on the device, replayed from CUDA graphs on a GPU); a batch with a sampled request
steps through the methods below.

Driven by step() (tests call it directly to place arrivals at exact steps); engine/scheduler.py
runs it on a thread behind the server.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from eagle3.core.common import Eagle3Error
from eagle3.core.spec import Spec
from eagle3.core.target import Target
from eagle3.engine.batch_forwards import (
    BatchTrees,
    causal,
    copy_row,
    counted_ancestors,
    draft_mask,
    drafter_forward,
    keep_best_rows,
    move_slots,
    subtrees,
    target_forward,
    tree_mask,
)
from eagle3.engine.batch_greedy import BatchGreedySteps
from eagle3.engine.decoder import DecodeRequest, GenerationResult, RequestStats, check_prompt
from eagle3.engine.kv import SlotKV
from eagle3.engine.llama import LeanDrafter, LeanLlama
from eagle3.engine.options import DecoderOptions
from eagle3.engine.runners import eager_attention
from eagle3.engine.sampling import Sampling, greedy_path, probabilities, sampled_path
from eagle3.engine.schedule import Schedule
from eagle3.engine.tree import top_children


@dataclass
class BatchRequest:
    """One request's decoding state while it waits, runs and after it finishes."""

    asked: DecodeRequest  # what the caller asked for
    budget: int  # tokens it may add (asked.max_new_tokens, less where the context ends first)
    sampling: Sampling
    stats: RequestStats
    started: float = field(default_factory=time.perf_counter)
    out: list[int] = field(default_factory=list)
    position: int = 0  # the root's position (tokens committed to the target's cache)
    finish: str | None = None
    result: GenerationResult | None = None
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    error: Exception | None = None  # raised by on_tokens, or a failed step

    @property
    def root(self) -> int:
        return self.out[-1]

    @property
    def context(self) -> list[int]:
        """The tokens in the target's cache when the request joins a batch: its prompt, and when it
        decoded elsewhere first (engine/scheduler.py's batch-1 path), what it committed there but
        its last token (the next step's root)."""
        return self.asked.prompt_ids + self.out[:-1]

    def cancel(self) -> None:
        """Leave at the next step boundary (finish_reason "abort"); safe from any thread."""
        self.cancelled = True


class BatchDecoder:
    """Draft with `drafter` (None with spec=off), verify with `target`, up to max_batch_size requests
    per step. Needs a plain Llama target and a drafter the lean forwards support (engine/llama.py)."""

    def __init__(
        self,
        target: Target,
        drafter,
        spec: Spec,
        max_batch_size: int,
        options: DecoderOptions | None = None,
        schedule: Schedule | None = None,
    ):
        """options: how it runs (engine/options.py; None: the defaults). schedule: the shape of
        each step chosen by the rows in it (engine/schedule.py; None: `spec` at every step)."""
        options = options or DecoderOptions()
        self.schedule = schedule or Schedule.fixed(spec)
        wide = [s for s in self.schedule.shapes if s.enabled]
        check_batchable(target, drafter, wide, max_batch_size)
        self.options = options
        self.deterministic = options.deterministic
        if options.deterministic:
            target, drafter = float64_copies(target, drafter if wide else None)
        self.target, self.spec, self.max_batch_size = target, spec, max_batch_size
        self.drafter = drafter if wide else None
        limit = target.config.max_position_embeddings
        self.max_context = min(options.max_context or limit, limit)
        self.device = target.device
        self.generator = torch.Generator().manual_seed(options.seed)
        self.tree_temperature = float(options.tree_temperature)
        self._target_caches()
        self.drafter_lean = self.drafter_kv = self.hidden = None
        if self.drafter is not None:
            self._drafter_caches(wide)
        graphs = options.cuda_graphs and self.device.type == "cuda"
        static = graphs or options.static_shapes
        self.greedy = {
            shape: BatchGreedySteps(self, shape, options.graph_batch_sizes, static, graphs)
            for shape in self.schedule.shapes
        }
        self.steps = 0  # speculative steps taken (each shared by every row in flight)
        self.row_steps = 0  # rows over those steps (row_steps / steps: the mean batch)
        self.rows_per_step: Counter[int] = Counter()  # rows in flight -> steps taken with that many
        self.shape_steps: Counter[str] = Counter()  # shape label -> steps taken with that shape
        self.decode_time_s = self.prefill_time_s = 0.0  # host wall time in decode() / prefill()
        self.rows: list[BatchRequest] = []  # in flight, row i of the caches
        self.waiting: list[BatchRequest] = []
        self.lock = threading.Lock()  # guards `waiting` (add() runs on other threads)

    def _target_caches(self) -> None:
        """The lean target and its row-per-request KV cache."""
        target = self.target
        q = max(s.depth for s in self.schedule.shapes)  # spec=off verifies its root alone: depth 1
        # a row's verify writes up to depth slots past its root, also where the tree does not fit
        self.target_lean = LeanLlama(target, self.max_context + q)
        config = target.config
        self.target_kv = SlotKV(
            config.num_hidden_layers,
            config.num_key_value_heads,
            self.target_lean.head_dim,
            self.max_context + q,
            target.model.model.embed_tokens.weight.dtype,
            self.device,
            batch=self.max_batch_size,
        )

    def _drafter_caches(self, wide: list[Spec]) -> None:
        """The lean drafter, its KV cache and each row's hidden state, room for the widest shape."""
        room = self.max_context + max(s.depth + s.steps * s.topk for s in wide)
        explicit = self.options.draft_attention == "explicit"
        self.drafter_lean = LeanDrafter(self.drafter, room, explicit)
        dc, dtype = self.drafter.config, self.drafter.fc.weight.dtype
        self.drafter_kv = SlotKV(
            dc.num_hidden_layers,
            dc.num_key_value_heads,
            dc.head_dim,
            room,
            dtype,
            self.device,
            batch=self.max_batch_size,
        )
        # each row's drafter hidden state after its last committed token (rows move with the caches)
        self.hidden = torch.zeros(
            self.max_batch_size, dc.hidden_size, dtype=dtype, device=self.device
        )

    # ------------------------------------------------------------ requests

    def check_prompt(self, prompt_ids: list[int]) -> None:
        check_prompt(prompt_ids, self.max_context)

    def add(self, asked: DecodeRequest) -> BatchRequest:
        """Queue a request; it joins the batch at the next step (its on_tokens is called on the
        stepping thread)."""
        self.check_prompt(asked.prompt_ids)
        request = BatchRequest(
            asked=asked,
            budget=asked.budget(self.max_context),
            sampling=asked.sampling(self.generator),
            stats=RequestStats(
                prompt_tokens=len(asked.prompt_ids),
                draft_tokens_per_step=max(s.depth for s in self.schedule.shapes) - 1,
                draft_tokens=0,
            ),
        )
        with self.lock:
            self.waiting.append(request)
        return request

    def take_lone(self) -> BatchRequest | None:
        """The waiting request when it is the only one (no rows in flight, no one else waiting),
        taken off the queue; else None."""
        with self.lock:
            if self.rows or len(self.waiting) != 1:
                return None
            return self.waiting.pop()

    def resume(self, request: BatchRequest) -> None:
        """A request that committed request.out elsewhere joins at the next step (its context
        prefilled, its last token the root)."""
        with self.lock:
            self.waiting.insert(0, request)

    @property
    def arrivals(self) -> bool:
        return bool(self.waiting)

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    @torch.inference_mode()
    def generate_all(self, requests: list[BatchRequest]) -> list[GenerationResult]:
        """Step until the given requests have finished -> their results."""
        while not all(r.done.is_set() for r in requests):
            self.step()
        return [r.result for r in requests]

    # ------------------------------------------------------------ one step

    @torch.inference_mode()
    def step(self) -> list[BatchRequest]:
        """Admit waiting requests (one batched prefill), then one speculative step over every row
        -> the requests that finished in it."""
        finished = self._retire()
        with self.lock:
            room = self.max_batch_size - len(self.rows)
            joining, self.waiting = self.waiting[:room], self.waiting[room:]
        # the attention width changes every step: cuDNN's attention would build a graph for each
        # new shape (runners.eager_attention)
        with eager_attention(cudnn=False):
            if joining:
                self.prefill(joining)
                finished += self._retire()
            if self.rows:
                self.decode()
                finished += self._retire()
        return finished

    def _retire(self) -> list[BatchRequest]:
        """Finished and cancelled rows leave; the last rows move into the holes (caches included)."""
        gone = []
        index = 0
        while index < len(self.rows):
            request = self.rows[index]
            if request.cancelled and request.finish is None:
                request.finish = "abort"
            if request.finish is None:
                index += 1
                continue
            last = len(self.rows) - 1
            if index != last:
                self._move_row(last, index)
            self.rows[index] = self.rows[last]
            self.rows.pop()
            self._complete(request)
            gone.append(request)
        return gone

    def _move_row(self, source: int, dest: int) -> None:
        length = self.rows[source].position + self.target_kv.max_len - self.max_context
        copy_row(self.target_kv, source, dest, min(length, self.target_kv.max_len))
        if self.drafter_kv is not None:
            copy_row(self.drafter_kv, source, dest, min(length, self.drafter_kv.max_len))
            self.hidden[dest] = self.hidden[source]

    def _complete(self, request: BatchRequest) -> None:
        stats = request.stats
        stats.total_time_s = time.perf_counter() - request.started
        tokens = request.out[: request.budget]
        for i, token in enumerate(tokens):
            if token in request.asked.stop_ids:
                tokens = tokens[: i + 1]
                break
        stats.completion_tokens = len(tokens)
        request.result = GenerationResult(tokens, request.finish, stats)
        request.done.set()

    def _commit(self, request: BatchRequest, new: list[int]) -> None:
        """Append a step's tokens and decide whether the request finishes (SpecDecoder's rules)."""
        request.out += new
        if any(t in request.asked.stop_ids for t in new):
            request.finish = "stop"
        elif request.asked.on_tokens is not None and self._tell(request, new):
            request.finish = "stop"
        elif len(request.out) >= request.budget:
            request.finish = "length"

    @staticmethod
    def _tell(request: BatchRequest, new: list[int]) -> bool:
        """on_tokens(the step's tokens within the budget); one that raises ends only its request."""
        try:
            return bool(
                request.asked.on_tokens(new[: request.budget - len(request.out) + len(new)])
            )
        except Exception as error:  # noqa: BLE001 -- the caller's callback, re-raised to the caller
            request.error = error
            return True

    def fail_all(self, error: Exception) -> None:
        """Every request in flight or waiting ends with `error` (a step failed); the rows empty."""
        with self.lock:
            failed, self.waiting = self.rows + self.waiting, []
        self.rows = []
        for request in failed:
            request.error, request.finish = error, "abort"
            request.result = GenerationResult(list(request.out), "abort", request.stats)
            request.done.set()

    # ------------------------------------------------------------ prefill

    def prefill(self, joining: list[BatchRequest]) -> None:
        """The newcomers' prompts through the target in one forward (padded to the longest), their
        first tokens, then the drafter over the prompts; they take the rows after the running ones."""
        started = time.perf_counter()
        lo = len(self.rows)
        rows = slice(lo, lo + len(joining))
        contexts = [r.context for r in joining]
        lengths = [len(c) for c in contexts]
        width = max(lengths)
        ids = torch.tensor([c + [0] * (width - len(c)) for c in contexts])
        ids = ids.to(self.device)
        positions = torch.arange(width, device=self.device).expand(len(joining), width)
        mask = causal(positions, width)
        logits, aux = target_forward(
            self.target_lean, self.target_kv, rows, ids, positions, positions, mask
        )
        last = logits[torch.arange(len(joining)), torch.tensor(lengths) - 1]
        resumed = [bool(r.out) for r in joining]
        roots = [
            r.root if again else self._first_token(row, r.sampling)
            for row, r, again in zip(last, joining, resumed)
        ]
        if self.drafter is not None:
            next_ids = ids.clone()
            next_ids[:, :-1] = ids[:, 1:]
            next_ids[torch.arange(len(joining)), torch.tensor(lengths) - 1] = torch.tensor(
                roots, device=self.device
            )
            hidden = self._extend(rows, next_ids, aux, positions, mask)
            last = torch.tensor(lengths, device=self.device) - 1
            self.hidden[rows] = hidden[torch.arange(len(joining), device=self.device), last]
        elapsed = time.perf_counter() - started
        self.prefill_time_s += elapsed
        for r, root, again, length in zip(joining, roots, resumed, lengths):
            r.position = length
            r.stats.prefill_time_s += elapsed
            self.rows.append(r)
            if not again:
                self._commit(r, [root])

    def _first_token(self, logits: torch.Tensor, sampling: Sampling) -> int:
        if sampling.random:
            probs = probabilities(logits, sampling.temperature, sampling.top_p)
            return int(torch.multinomial(probs.cpu(), 1, generator=sampling.generator))
        return int(logits.argmax())

    def _extend(self, rows: slice, ids, aux, positions, mask) -> torch.Tensor:
        """Committed tokens with the target's aux states through the drafter -> its hidden [B, m, H]."""
        states = self.drafter.project(aux.to(self.drafter.fc.weight.dtype))
        return drafter_forward(
            self.drafter_lean, self.drafter_kv, rows, ids, states, positions, positions, mask
        )

    # ------------------------------------------------------------ decode

    def decode(self) -> None:
        """One draft + verify + commit over every row: a greedy batch on BatchGreedySteps' device
        path (CUDA graphs on a GPU), a batch with a sampled row step by step here."""
        t0 = time.perf_counter()
        self.steps += 1
        batch = len(self.rows)
        self.row_steps += batch
        shape = self.schedule.shape_for(batch)
        self.rows_per_step[batch] += 1
        self.shape_steps[shape.label] += 1
        if not any(r.sampling.random for r in self.rows):
            committed, draft_s, verify_s = self.greedy[shape].step(self.rows)
            self.decode_time_s += time.perf_counter() - t0
            for request, new in zip(self.rows, committed):
                self._record(request, new, draft_s, verify_s, shape)
            return
        rows = slice(0, batch)
        position = torch.tensor([r.position for r in self.rows], device=self.device)
        roots = torch.tensor([r.root for r in self.rows], device=self.device)
        if shape.enabled:
            trees = self.draft(roots, position, self.hidden[rows], shape=shape)
            trees.sizes = self.tree_sizes([r.position for r in self.rows], shape)
        else:
            zero = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
            trees = BatchTrees(roots[:, None], zero, zero, [1] * batch, {})
        t1 = time.perf_counter()
        paths, bonuses, aux, tokens = self.verify(trees, position, shape)
        t2 = time.perf_counter()
        news = [
            [row[node] for node in path[1:]] + [bonus]
            for row, path, bonus in zip(tokens, paths, bonuses)
        ]
        if self.drafter is not None:  # also at spec=off steps: a later step's shape may draft
            self._extend_committed(rows, news, paths, aux, position)
        t3 = time.perf_counter()
        self.decode_time_s += t3 - t0
        for request, new in zip(self.rows, news):
            self._record(request, new, (t1 - t0) + (t3 - t2), t2 - t1, shape)

    def _record(self, request: BatchRequest, new: list[int], draft_s, verify_s, shape: Spec):
        """A step's committed tokens (accepted drafts, then the bonus) and its times."""
        stats = request.stats
        stats.verify_steps += 1
        stats.draft_tokens += shape.depth - 1
        stats.accepted_per_step.append(len(new) - 1)
        stats.draft_time_s += draft_s
        stats.verify_time_s += verify_s
        request.position += len(new)
        self._commit(request, new)

    def tree_sizes(self, positions: list[int], shape: Spec) -> list[int]:
        """Nodes each row verifies: the whole tree, or its root alone where the tree would pass the
        context."""
        depth = shape.depth
        return [depth if p + depth <= self.max_context else 1 for p in positions]

    def verify(self, trees: BatchTrees, position: torch.Tensor, shape: Spec):
        """One target forward over every row's tree; keeps each accepted path's K/V.
        -> (path node indices per row, bonus token per row, aux [B, q, 3H], tree tokens per row)."""
        batch, q = trees.tokens.shape
        sizes = torch.tensor(trees.sizes, device=self.device)
        ancestors, _ = counted_ancestors(trees.parents, sizes, max(shape.steps, 0))
        slots = position[:, None] + torch.arange(q, device=self.device)
        kv_len = int(position.max()) + q
        mask = tree_mask(position, ancestors, kv_len)
        positions = (position[:, None] + trees.depths).clamp_max(self.target_lean.cos.shape[0] - 1)
        logits, aux = target_forward(
            self.target_lean, self.target_kv, slice(0, batch), trees.tokens, positions, slots, mask
        )
        tokens, parents = trees.tokens.tolist(), trees.parents.tolist()
        argmax = logits.argmax(dim=-1).tolist()
        paths, bonuses = [], []
        for index, request in enumerate(self.rows):
            size, sampling = trees.sizes[index], request.sampling
            if sampling.random:
                probs = probabilities(logits[index, :size], sampling.temperature, sampling.top_p)
                path, bonus = sampled_path(
                    tokens[index][:size],
                    parents[index][:size],
                    probs,
                    trees.draft_probs.get(index),
                    sampling.generator,
                )
            else:
                path, bonus = greedy_path(
                    tokens[index][:size], parents[index][:size], argmax[index][:size]
                )
            paths.append(path)
            bonuses.append(bonus)
        self._keep_paths(paths, position.tolist())
        return paths, bonuses, aux, tokens

    def _keep_paths(self, paths: list[list[int]], positions: list[int]) -> None:
        rows, sources, dests = [], [], []
        for row, (path, start) in enumerate(zip(paths, positions)):
            for offset, node in enumerate(path):
                if node != offset:
                    rows.append(row)
                    sources.append(start + node)
                    dests.append(start + offset)
        if rows:
            as_tensor = lambda values: torch.tensor(values, device=self.device)
            move_slots(self.target_kv, as_tensor(rows), as_tensor(sources), as_tensor(dests))

    def _extend_committed(self, rows: slice, news, paths, aux, position) -> None:
        """The drafter over each row's committed tokens (the accepted nodes' aux states, the token
        after each), padded to the longest row; each row's last hidden becomes its row of self.hidden."""
        batch, width = len(news), max(len(new) for new in news)
        ids = torch.tensor([new + [0] * (width - len(new)) for new in news], device=self.device)
        nodes = torch.tensor(
            [path + [0] * (width - len(path)) for path in paths], device=self.device
        )
        states = aux.gather(1, nodes[:, :, None].expand(-1, -1, aux.shape[-1]))
        positions = position[:, None] + torch.arange(width, device=self.device)
        mask = causal(positions, int(position.max()) + width)
        hidden = self._extend(rows, ids, states, positions, mask)
        last = torch.tensor([len(new) - 1 for new in news], device=self.device)
        self.hidden[rows] = hidden[torch.arange(batch, device=self.device), last]

    # ------------------------------------------------------------ drafting

    def draft(
        self,
        roots: torch.Tensor,
        position: torch.Tensor,
        h_last: torch.Tensor,
        cache_width: int | None = None,
        sample: bool = True,
        shape: Spec | None = None,
    ) -> BatchTrees:
        """Every row's EAGLE-2 dynamic tree (a chain when topk=1), SpecDecoder.draft's steps with a
        batch dimension, from each row's root, position and drafter hidden h_last [B, H] (sizes left
        to the caller). cache_width: the cache slots attention reads (None: as many as are in use).
        sample: sampled chains draw their children from the drafter (False: every row greedy).
        shape: the step's spec (None: the decoder's)."""
        shape = shape or self.spec
        k, steps, dev, batch = shape.topk, shape.steps, self.device, roots.numel()
        sampled = [
            index
            for index, r in enumerate(self.rows)
            if sample and r.sampling.random and shape.chain
        ]
        total = 1 + k + (steps - 1) * k * k
        tokens = [roots[:, None]]
        parents = [torch.zeros(batch, 1, dtype=torch.long, device=dev)]
        depths = [torch.zeros(batch, 1, dtype=torch.long, device=dev)]
        scores = [torch.zeros(batch, 1, device=dev)]
        q_rows: dict[int, list[torch.Tensor]] = {
            i: [torch.zeros(1, self.target.vocab_size, device=dev)] for i in sampled
        }
        slot_of = torch.full((batch, total), -1, dtype=torch.long, device=dev)
        frontier = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        frontier_hidden = h_last[:, None]
        count = 1
        rows = slice(0, batch)
        for step in range(steps):
            width = frontier.shape[1]
            if step > 0:
                slot_of.scatter_(
                    1,
                    frontier,
                    position[:, None] + (step - 1) * k + torch.arange(width, device=dev),
                )
                all_parents = torch.cat(parents, dim=1)
                kv_len = cache_width or int(position.max()) + step * k
                mask = draft_mask(frontier, slot_of, all_parents, position, step, kv_len)
                ids = torch.cat(tokens, dim=1).gather(1, frontier)
                pos = (position[:, None] + step - 1).expand(batch, width)
                frontier_hidden = drafter_forward(
                    self.drafter_lean,
                    self.drafter_kv,
                    rows,
                    ids,
                    frontier_hidden,
                    pos,
                    slot_of.gather(1, frontier),
                    mask,
                )
            logits = self.drafter_lean.logits(frontier_hidden)  # [B, w, Vd]
            base = torch.cat(scores, dim=1).gather(1, frontier)
            log_probs, ids = top_children(
                logits.reshape(batch * width, -1), k, self.tree_temperature
            )
            child_tokens = self.drafter.to_target_ids(ids).view(batch, width * k)
            child_scores = (base[:, :, None] + log_probs.view(batch, width, k)).view(batch, -1)
            for index in sampled:  # a sampled chain draws its child from q
                self._sample_child(index, logits[index], child_tokens, child_scores, q_rows)
            tokens.append(child_tokens)
            scores.append(child_scores)
            parents.append(frontier.repeat_interleave(k, dim=1))
            depths.append(torch.full((batch, width * k), step + 1, dtype=torch.long, device=dev))
            best = torch.sort(child_scores, dim=1, descending=True, stable=True).indices[:, :k]
            frontier_hidden = frontier_hidden.gather(
                1, (best // k)[:, :, None].expand(-1, -1, frontier_hidden.shape[-1])
            )
            frontier = count + best
            count += width * k
        nodes = keep_best_rows(torch.cat(scores, dim=1), shape.depth - 1)
        trees = subtrees(nodes, torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(depths, 1))
        trees.draft_probs = {i: torch.cat(q_rows[i]) for i in sampled}  # chains keep every node
        return trees

    def _sample_child(self, index, logits, child_tokens, child_scores, q_rows) -> None:
        sampling, drafter = self.rows[index].sampling, self.drafter
        q_draft = probabilities(logits, sampling.temperature, sampling.top_p)  # [1, Vd]
        choice = torch.multinomial(q_draft.cpu(), 1, generator=sampling.generator).to(self.device)
        child_tokens[index] = drafter.to_target_ids(choice).view(-1)
        child_scores[index] = q_draft.gather(-1, choice).log().view(-1)
        q_target = torch.zeros(1, self.target.vocab_size, device=self.device)
        q_target.index_add_(
            1, drafter.to_target_ids(torch.arange(q_draft.shape[-1], device=self.device)), q_draft
        )
        q_rows[index].append(q_target)


def check_batchable(target: Target, drafter, wide: list[Spec], max_batch_size: int) -> None:
    """Refuse what the batched forwards cannot run: a drafting shape without a drafter, fewer than
    one row, a target other than a plain Llama, a drafter whose layer is not batched."""
    if wide and drafter is None:
        raise Eagle3Error(f"spec {wide[0].label} needs a drafter; use spec=off for plain decoding")
    if max_batch_size < 1:
        raise Eagle3Error(f"engine.max_batch_size={max_batch_size}: must be >= 1")
    if not LeanLlama.supports(target.model):
        raise Eagle3Error(
            f"engine.max_batch_size={max_batch_size} batches a plain Llama target only "
            f"({target.config.model_type} here); use engine.max_batch_size=1"
        )
    if wide and not LeanDrafter.supports(drafter):
        raise Eagle3Error("engine.max_batch_size > 1: this drafter's layer is not batched")


def float64_copies(target: Target, drafter):
    """engine.deterministic: the target and the drafter with their weights in float64 (bf16 and
    float32 weights convert exactly). A kernel's summation order (which changes with the batch, the
    tree width and the cache width) then moves a logit by ~1e-16 of its size, so two runs commit
    different tokens only where two logits tie that closely; in the weights' own dtype the same
    order changes reach 1e-7 (float32) to 1e-2 (bf16) and flip near-ties."""
    model = copy.deepcopy(target.model).to(torch.float64)
    wide = dataclasses.replace(target, model=model)
    return wide, None if drafter is None else copy.deepcopy(drafter).to(torch.float64)
