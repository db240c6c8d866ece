"""The speculative decoder, batch 1: prefill, then draft -> verify -> accept -> commit.

Positions: the prompt fills 0..n-1; the root (the newest token, not yet in the target's
cache) sits at position P. The drafter's cache entry at position t pairs the target's
aux state at t with token t+1, so after each commit it holds 0..P-1 and its last output
predicts the root's child. A verify step feeds the root and the draft tree at positions
P + depth, slots P..P+q-1, one target forward; the accepted path's K/V (target) are
gathered back to slots P.., and the drafter is extended with the path's aux states.
spec=off is the same loop with a root-only tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from eagle3.core.common import Eagle3Error, log
from eagle3.core.spec import Spec
from eagle3.core.target import Target
from eagle3.engine.fused import FusedGreedy
from eagle3.engine.options import DecoderOptions
from eagle3.engine.runners import DrafterRunner, TargetRunner
from eagle3.engine.sampling import Sampling, greedy_path, probabilities, sampled_path
from eagle3.engine.tree import DraftTree, ancestor_mask, keep_best, root_only, subtree, top_children


class ContextOverflow(Eagle3Error):
    """The prompt does not fit the engine's context."""


def check_prompt(prompt_ids: list[int], max_context: int) -> None:
    """Refuse an empty prompt or one that leaves no room for a completion in the context."""
    if not prompt_ids:
        raise Eagle3Error("empty prompt: give at least one token")
    if len(prompt_ids) >= max_context:
        raise ContextOverflow(
            f"prompt has {len(prompt_ids)} tokens but the context holds {max_context} "
            f"(prompt + completion); at most {max_context - 1} prompt tokens"
        )


@dataclass
class DecodeRequest:
    """One request as the decoders take it (SpecDecoder.generate, BatchDecoder.add,
    BatchScheduler.generate). on_tokens(new) is called after every step with the newly committed
    tokens (within max_new_tokens); returning True stops (stop strings, streaming). generator:
    this request's sampling generator (a per-request seed); None draws from the decoder's running
    one (seeded once, engine.seed)."""

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop_ids: Collection[int] = frozenset()
    on_tokens: Callable[[list[int]], bool] | None = None
    generator: torch.Generator | None = None

    def __post_init__(self):
        # copies: a caller that reuses its list or set cannot change a request in flight
        self.prompt_ids = list(self.prompt_ids)
        self.stop_ids = frozenset(self.stop_ids)

    def budget(self, max_context: int) -> int:
        """Tokens this request may add: max_new_tokens, less where the context ends first."""
        return min(self.max_new_tokens, max_context - len(self.prompt_ids))

    def sampling(self, running: torch.Generator) -> Sampling:
        """How it chooses tokens; `running`: the decoder's generator, used without its own."""
        return Sampling(self.temperature, self.top_p, self.generator or running)


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    verify_steps: int = 0
    accepted_per_step: list[int] = field(
        default_factory=list
    )  # accepted draft tokens per verify step
    draft_tokens_per_step: int = 0  # candidates verified per step (depth - 1)
    # candidates verified in all; None: draft_tokens_per_step x verify_steps (one shape throughout)
    draft_tokens: int | None = None
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def tau(self) -> float:
        """Acceptance length: completion tokens per verify step (SGLang's definition)."""
        return self.completion_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def accepted_per_position(self) -> list[int]:
        """Steps whose accepted path reached draft position i (0-based), for i < depth - 1."""
        return [
            sum(a > i for a in self.accepted_per_step) for i in range(self.draft_tokens_per_step)
        ]

    @property
    def verified_drafts(self) -> int:
        """Draft tokens verified over the request's steps."""
        if self.draft_tokens is None:
            return self.draft_tokens_per_step * self.verify_steps
        return self.draft_tokens

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "verify_steps": self.verify_steps,
            "tau": self.tau,
            "accepted_tokens": sum(self.accepted_per_step),
            "accepted_per_step": self.accepted_per_step,
            "accepted_per_position": self.accepted_per_position,
            "draft_tokens": self.verified_drafts,
            "prefill_time_s": self.prefill_time_s,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "total_time_s": self.total_time_s,
        }


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str  # "stop" | "length"
    stats: RequestStats


class SpecDecoder:
    """Draft with `drafter` (None only with spec=off), verify with `target`, keep what matches."""

    def __init__(self, target: Target, drafter, spec: Spec, options: DecoderOptions | None = None):
        """options: how it runs (engine/options.py; None: the defaults)."""
        if spec.enabled and drafter is None:
            raise Eagle3Error(f"spec {spec.label} needs a drafter; use spec=off for plain decoding")
        self.options = options = options or DecoderOptions()
        self.tree_temperature = float(options.tree_temperature)
        self.target, self.spec = target, spec
        self.drafter = drafter if spec.enabled else None
        limit = target.config.max_position_embeddings
        self.max_context = min(options.max_context or limit, limit)
        self.target_run = TargetRunner(
            target,
            self.max_context,
            lean=options.lean,
            eager_cudnn=options.eager_cudnn,
            compile_layers=options.compile_layers,
        )
        self.drafter_run = (
            DrafterRunner(
                self.drafter,
                self.max_context + spec.steps * spec.topk,
                lean=options.lean,
                eager_cudnn=options.eager_cudnn,
                explicit_attention=options.draft_attention == "explicit",
            )
            if self.drafter is not None
            else None
        )
        self.device = target.device
        self.generator = torch.Generator().manual_seed(options.seed)
        self.root_host = torch.zeros(1, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.fused = (
            FusedGreedy(
                spec,
                self.target_run,
                self.drafter_run,
                self.max_context,
                self.tree_temperature,
                options.compile_draft,
            )
            if options.fused
            else None
        )
        self.prefill_widths: list[int] = []  # prompt lengths are padded up to the first that fits
        if options.cuda_graphs and self.device.type == "cuda":
            widths = set(options.prefill_graphs)
            self.capture_graphs(sorted(w for w in widths if w < self.max_context))

    # ------------------------------------------------------------ public

    @torch.inference_mode()
    def generate(self, request: DecodeRequest) -> GenerationResult:
        """Decode up to request.max_new_tokens after its prompt (DecodeRequest says how)."""
        prompt_ids = request.prompt_ids
        self.check_prompt(prompt_ids)
        stats = RequestStats(
            prompt_tokens=len(prompt_ids),
            draft_tokens_per_step=self.spec.depth - 1 if self.spec.enabled else 0,
        )
        started = time.perf_counter()
        budget = request.budget(self.max_context)
        sampling = request.sampling(self.generator)
        root, h_last = self.prefill(prompt_ids, sampling)
        stats.prefill_time_s = time.perf_counter() - started
        out, stop_ids, on_tokens = [root], request.stop_ids, request.on_tokens
        finish = self._finished(out, budget, stop_ids, on_tokens, [root])
        position, pending = len(prompt_ids), None
        while finish is None:
            if (
                pending is None
                and not sampling.random
                and self.fused is not None
                and self.fused.fits(position)
            ):
                pending = self.fused.launch(root, position, h_last)
            if pending is not None:
                ahead = self._launch_ahead(position, len(out), budget)
                new, h_last = self.fused.collect(pending, stats)
                pending = ahead
            else:
                new, h_last = self.step(root, position, h_last, sampling, stats)
            out += new
            position += len(new)
            root = new[-1]
            finish = self._finished(out, budget, stop_ids, on_tokens, new)
        stats.total_time_s = time.perf_counter() - started
        tokens = self._truncate(out, budget, stop_ids)
        stats.completion_tokens = len(tokens)
        return GenerationResult(tokens, finish, stats)

    def _launch_ahead(self, position: int, produced: int, budget: int):
        """With options.overlap_steps, the fused step after the one in flight, enqueued before the host reads
        that one, so the device never waits on the host. Launched only where it fits and the budget
        cannot run out in the step before it; a stop token there leaves it unused (at most one per request)."""
        furthest = position + self.fused.max_commit
        if (
            self.options.overlap_steps
            and self.fused.fits(furthest)
            and produced + self.fused.max_commit < budget
        ):
            return self.fused.launch_next(furthest)
        return None

    def check_prompt(self, prompt_ids: list[int]) -> None:
        check_prompt(prompt_ids, self.max_context)

    # ------------------------------------------------------------ steps

    def prefill(self, prompt_ids: list[int], sampling: Sampling) -> tuple[int, torch.Tensor | None]:
        """The prompt through the target, then the drafter -> (the first new token, the drafter's last hidden).
        The host reads that token from a copy that waits for the target's pass alone, so the drafter's pass
        is enqueued while the GPU still runs the prompt and runs while the host launches the first step."""
        ids = torch.tensor(prompt_ids, device=self.device)
        n = ids.numel()
        width = next((w for w in self.prefill_widths if w >= n), n)
        positions = torch.arange(width, device=self.device)
        logits, aux = self.target_run.forward(
            _pad(ids, width), positions, positions, self.causal_mask(0, width, self.target_run)
        )
        if sampling.random:
            root = torch.tensor([self.draw(logits[n - 1], sampling)], device=self.device)
        else:
            root = logits[n - 1].argmax().view(1)
        if self.drafter_run is None:
            return int(root), None
        ready = self._copy_to_host(root)
        h_last = self.extend_drafter(torch.cat([ids[1:], root]), aux[:n], 0)
        if ready is not None:
            ready.synchronize()  # the prompt's pass only: the drafter's may still run
        return int(self.root_host), h_last

    def _copy_to_host(self, token: torch.Tensor):
        """token [1] into self.root_host -> the event to wait on (CUDA), or None (copied already)."""
        self.root_host.copy_(token, non_blocking=self.device.type == "cuda")
        if self.device.type != "cuda":
            return None
        ready = torch.cuda.Event()
        ready.record()
        return ready

    def step(self, root: int, position: int, h_last, sampling: Sampling, stats: RequestStats):
        """One draft + verify; returns (the committed tokens incl. the bonus, the drafter's last hidden)."""
        t0 = time.perf_counter()
        fits = position + self.spec.depth <= self.max_context
        root_t = torch.tensor([root], device=self.device)
        if self.drafter_run is not None and fits:
            tree = self.draft(root_t, position, h_last, sampling)
        else:
            tree = root_only(root_t)
        t1 = time.perf_counter()
        path, bonus, path_aux = self.verify(tree, position, sampling)
        new = (
            [int(t) for t in tree.tokens[path[1:]].tolist()] + [bonus] if len(path) > 1 else [bonus]
        )
        t2 = time.perf_counter()
        if self.drafter_run is not None:  # (aux of each accepted node, the token after it)
            h_last = self.extend_drafter(torch.tensor(new, device=self.device), path_aux, position)
        stats.verify_steps += 1
        stats.accepted_per_step.append(len(path) - 1)
        stats.draft_time_s += (t1 - t0) + (time.perf_counter() - t2)
        stats.verify_time_s += t2 - t1
        return new, h_last

    def verify(self, tree: DraftTree, position: int, sampling: Sampling):
        """One target forward over the tree; keeps the accepted path's K/V.
        Returns (path node indices, bonus token, the path's aux states)."""
        q = tree.size
        slots = torch.arange(position, position + q, device=self.device)
        mask = self.tree_mask(
            position, ancestor_mask(tree.parents, self.spec.steps), self.target_run
        )
        logits, aux = self.target_run.forward(tree.tokens, position + tree.depths, slots, mask)
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        if sampling.random:
            probs = probabilities(logits, sampling.temperature, sampling.top_p)
            path, bonus = sampled_path(tokens, parents, probs, tree.draft_probs, sampling.generator)
        else:
            path, bonus = greedy_path(tokens, parents, logits.argmax(dim=-1).tolist())
        path_t = torch.tensor(path, device=self.device)
        self.target_run.kv.keep(position, position + path_t)
        return path, bonus, aux[path_t]

    def extend_drafter(self, next_ids: torch.Tensor, aux: torch.Tensor, start: int) -> torch.Tensor:
        run, m = self.drafter_run, next_ids.numel()
        width = min((q for kind, q in run.graphs if kind == "extend" and q >= m), default=m)
        ids = _pad(next_ids, width)
        states = _pad(aux, width)
        positions = torch.arange(start, start + width, device=self.device)
        hidden, _ = run.extend(
            ids, states, positions, positions, self.causal_mask(start, width, run)
        )
        return hidden[m - 1 : m]

    # ------------------------------------------------------------ drafting

    def draft(
        self, root: torch.Tensor, position: int, h_last: torch.Tensor, sampling: Sampling
    ) -> DraftTree:
        """EAGLE-2 dynamic tree (a chain when topk=1): see tree.py."""
        k, steps, dev = self.spec.topk, self.spec.steps, self.device
        sample_chain = sampling.random and self.spec.chain
        tokens, parents, depths, scores = (
            [root],
            [torch.zeros(1, dtype=torch.long, device=dev)],
            [torch.zeros(1, dtype=torch.long, device=dev)],
            [torch.zeros(1, device=dev)],
        )
        slot_of = torch.full((1 + k + (steps - 1) * k * k,), -1, dtype=torch.long, device=dev)
        q_rows = [torch.zeros(1, self.target.vocab_size, device=dev)] if sample_chain else None
        frontier = torch.zeros(1, dtype=torch.long, device=dev)
        frontier_hidden = h_last
        count = 1
        for step in range(steps):
            if step > 0:  # run the drafter on the frontier (nodes at depth `step`)
                width = frontier.numel()
                slot_of[frontier] = position + (step - 1) * k + torch.arange(width, device=dev)
                mask = self.draft_mask(frontier, slot_of, torch.cat(parents), position, step, width)
                ids = torch.cat(tokens)[frontier]
                pos = torch.full((width,), position + step - 1, device=dev)
                frontier_hidden, logits = self.drafter_run.step(
                    ids, frontier_hidden, pos, slot_of[frontier], mask
                )
            else:
                logits = self.drafter_run.logits(h_last)
            base = torch.cat(scores)[frontier]
            child_tokens, child_scores, q = self.propose(logits, base, sampling, sample_chain)
            width = child_tokens.numel()
            tokens.append(child_tokens.reshape(-1))
            scores.append(child_scores.reshape(-1))
            parents.append(frontier.repeat_interleave(child_tokens.shape[1]))
            depths.append(torch.full((width,), step + 1, dtype=torch.long, device=dev))
            if q_rows is not None:
                q_rows.append(q)
            best = torch.sort(child_scores.reshape(-1), descending=True, stable=True).indices[:k]
            frontier_hidden = frontier_hidden[best // child_tokens.shape[1]]
            frontier = count + best
            count += width
        all_scores, all_parents = torch.cat(scores), torch.cat(parents)
        nodes = keep_best(all_scores, all_parents, self.spec.depth - 1)
        return subtree(
            nodes,
            torch.cat(tokens),
            all_parents,
            torch.cat(depths),
            torch.cat(q_rows) if q_rows is not None else None,
        )

    def propose(self, logits, base, sampling: Sampling, sample_chain: bool):
        """Children of each frontier row: (target token ids [w, c], cumulative scores [w, c], q rows or None)."""
        drafter = self.drafter_run.drafter
        if sample_chain:
            q_draft = probabilities(logits, sampling.temperature, sampling.top_p)
            choice = torch.multinomial(q_draft.cpu(), 1, generator=sampling.generator).to(
                self.device
            )
            score = base[:, None] + q_draft.gather(-1, choice).log()
            q_target = torch.zeros(q_draft.shape[0], self.target.vocab_size, device=self.device)
            q_target.index_add_(
                1,
                drafter.to_target_ids(torch.arange(q_draft.shape[-1], device=self.device)),
                q_draft,
            )
            return drafter.to_target_ids(choice), score, q_target
        log_probs, ids = top_children(logits, self.spec.topk, self.tree_temperature)
        return drafter.to_target_ids(ids), base[:, None] + log_probs, None

    # ------------------------------------------------------------ masks

    def causal_mask(self, start: int, length: int, runner) -> torch.Tensor:
        """Queries at slots start.. see every earlier slot and themselves."""
        width = runner.kv_len(start + length)
        cols = torch.arange(width, device=self.device)
        rows = torch.arange(start, start + length, device=self.device)
        return cols[None, :] <= rows[:, None]

    def tree_mask(self, position: int, ancestors: torch.Tensor, runner) -> torch.Tensor:
        q = ancestors.shape[0]
        mask = torch.zeros(q, runner.kv_len(position + q), dtype=torch.bool, device=self.device)
        mask[:, :position] = True
        mask[:, position : position + q] = ancestors
        return mask

    def draft_mask(
        self, frontier, slot_of, parents, position: int, step: int, width: int
    ) -> torch.Tensor:
        """Frontier nodes (depth `step`) see the committed prefix and their ancestors' draft slots."""
        used = step * self.spec.topk
        mask = torch.zeros(
            width, self.drafter_run.kv_len(position + used), dtype=torch.bool, device=self.device
        )
        mask[:, :position] = True
        rows, current = torch.arange(width, device=self.device), frontier
        for _ in range(step):
            mask[rows, slot_of[current]] = True
            current = parents[current]
        return mask

    # ------------------------------------------------------------ helpers

    def draw(self, logits: torch.Tensor, sampling: Sampling) -> int:
        probs = probabilities(logits, sampling.temperature, sampling.top_p)
        return int(torch.multinomial(probs.cpu(), 1, generator=sampling.generator))

    def _finished(self, out, budget, stop_ids, on_tokens, new) -> str | None:
        if any(t in stop_ids for t in new):
            return "stop"
        if on_tokens is not None and on_tokens(
            new[: budget - len(out) + len(new)]
        ):  # not past the budget
            return "stop"
        return "length" if len(out) >= budget else None

    @staticmethod
    def _truncate(out: list[int], budget: int, stop_ids: Collection[int]) -> list[int]:
        out = out[:budget]
        for i, token in enumerate(out):
            if token in stop_ids:
                return out[: i + 1]
        return out

    @torch.no_grad()  # a drafter fresh from training still requires grad; captured kernels write caches in place
    def capture_graphs(self, prefill_widths: list[int]) -> None:
        """CUDA graphs for every fixed-shape forward: verify (q = depth, and 1), draft steps
        (q = 1..topk frontier rows), the drafter extend (padded to depth) and the prefill widths
        (the target's and the drafter's extend)."""
        pool = torch.cuda.graph_pool_handle()
        lengths = [1, self.spec.depth] if self.spec.enabled else [1]
        self.target_run.capture(lengths, pool, compiled=self.target_run.compile_layers)
        self.target_run.capture(
            [w for w in prefill_widths if w not in lengths],
            pool,
            compiled=self.options.compile_prefill,
        )
        if self.drafter_run is not None:
            shapes = [("extend", w) for w in [self.spec.depth, *prefill_widths]] + [
                ("step", w) for w in {1, self.spec.topk}
            ]
            self.drafter_run.capture(shapes, pool)
        self.prefill_widths = prefill_widths
        if self.fused is not None:
            try:
                self.fused.capture(
                    torch.cuda.graph_pool_handle()
                )  # its own pool: the old graphs replay in between
            except Exception as error:  # noqa: BLE001 -- keep serving on the step-by-step graphs
                log.warning(
                    "fused step graphs failed to capture (%s); using the step-by-step path", error
                )
                self.fused = None
        torch.cuda.synchronize()
        log.info(
            "captured CUDA graphs: target %s, drafter %s",
            sorted(self.target_run.graphs),
            sorted(self.drafter_run.graphs) if self.drafter_run else [],
        )


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.shape[0] >= width:
        return x
    pad = torch.zeros((width - x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    return torch.cat([x, pad])
