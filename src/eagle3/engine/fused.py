"""Greedy decode steps with static shapes, kept on the device from draft to commit.

The same work as SpecDecoder.step for temperature 0 (see decoder.py for positions and
slots), written without host reads: the step's position is a device scalar, every mask
is built from comparisons at the caches' full width, the acceptance walk is tensor
algebra over the ancestor mask, and the accepted path's K/V moves with one gather per
cache. Each phase (draft, verify, extend) is one function of the static buffers below,
run eagerly or replayed as one CUDA graph; the host reads one small tensor per step, from a
pinned copy, while the next step (launched from the device's own state) may already run.

Greedy acceptance on the device: node i is accepted when its token is the target's
argmax at its parent and so is every ancestor's; siblings hold distinct tokens, so the
accepted nodes form one chain from the root and its deepest node ends the path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from eagle3.core.spec import Spec
from eagle3.engine.llama import compile_fixed
from eagle3.engine.runners import DrafterRunner, Graphed, TargetRunner
from eagle3.engine.tree import ancestor_mask, keep_best, subtree, top_children


def mark(device: torch.device):
    """A point in the device's stream (a recorded CUDA event), or the host clock on a CPU."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def phase_seconds(marks) -> tuple[float, float]:
    """Marks around the draft, verify (and extend) phases -> (draft + extend, verify) seconds;
    events are complete once the step's read returned."""
    if isinstance(marks[0], float):
        spans = [b - a for a, b in zip(marks, marks[1:])]
    else:
        spans = [a.elapsed_time(b) / 1000 for a, b in zip(marks, marks[1:])]
    return spans[0] + sum(spans[2:]), spans[1]


@dataclass
class Pending:
    """A launched step: its host copy's slot, its phase marks and the mark after its copy."""

    slot: int
    marks: list
    done: object


class FusedGreedy:
    def __init__(
        self,
        spec: Spec,
        target_run: TargetRunner,
        drafter_run: DrafterRunner | None,
        max_context: int,
        tree_temperature: float = 1.0,
        compiled: bool = False,
    ):
        """The batch-1 decoder's runners (drafter_run None: spec=off) and context. compiled: the
        draft and extend phases (the drafter's layer and the tree bookkeeping, many small kernels)
        go through torch.compile; verify's target layers follow target_run.compile_layers."""
        self.spec, self.device, self.max_context = spec, target_run.device, max_context
        self.target_run, self.drafter_run = target_run, drafter_run
        self.tree_temperature = tree_temperature
        # verified nodes per step (root included)
        self.size = self.spec.depth if self.spec.enabled else 1
        self.root = torch.zeros(1, dtype=torch.long, device=self.device)
        self.position = torch.zeros((), dtype=torch.long, device=self.device)
        # what the host reads (accepted count, committed tokens): one buffer that every width's graphs write
        self.max_commit = (
            min(self.size, self.spec.steps + 1) if self.spec.enabled else 1
        )  # tokens one step commits
        self.packed = torch.zeros(1 + self.max_commit, dtype=torch.long, device=self.device)
        # two host copies: the host reads one step's while the next step (launched before the read) runs
        self.host = [
            torch.zeros(
                1 + self.max_commit, dtype=torch.long, pin_memory=self.device.type == "cuda"
            )
            for _ in range(2)
        ]
        self.next_slot = 0
        self.hidden = None
        if self.drafter_run is not None:
            self.hidden = torch.zeros(
                1,
                self.drafter_run.drafter.config.hidden_size,
                dtype=self.drafter_run.dtype,
                device=self.device,
            )
        self.phases = [self.draft, self.verify] + (
            [self.extend] if self.drafter_run is not None else []
        )
        if compiled and self.drafter_run is not None:
            # not dynamic=False: each cache width is a new length of the masks and of the cache slice
            # attention reads; automatic dynamic shapes compile the second width generically, so a
            # phase compiles twice instead of once per width
            self.phases = [compile_fixed(self.draft), self.verify, compile_fixed(self.extend)]
        self.graphs: dict[int, list[Graphed]] = {}  # cache width -> one graph per phase
        self.held: dict[int, list] = {}
        # attention reads only the cache slots in use, rounded up to a power of two (a graph each)
        self.reach = (
            self.size
            if self.drafter_run is None
            else max(self.size, self.spec.steps * self.spec.topk)
        )
        self.widths = sorted(
            {
                min(2**n, max_context + self.reach)
                for n in range(8, max(8, (max_context + self.reach - 1).bit_length()) + 1)
            }
        )
        self.width = self.widths[-1]

    def fits(self, position: int) -> bool:
        return position + self.size <= self.max_context

    # ------------------------------------------------------------ the host side

    def launch(self, root: int, position: int, h_last) -> Pending:
        """Enqueue a step from the host's (root, position, drafter hidden)."""
        self.root.fill_(root)
        self.position.fill_(position)
        if self.hidden is not None and h_last is not self.hidden:
            self.hidden.copy_(h_last)
        return self.launch_next(position)

    def launch_next(self, position_bound: int) -> Pending:
        """Enqueue a step from the device's state, which the last step's commit left; the host need not
        know its results yet. position_bound: the furthest position it can start at (the cache width)."""
        self.width = next(w for w in self.widths if w >= position_bound + self.reach)
        graphs = self.graphs.get(self.width)
        marks = [self._mark()]
        for index, phase in enumerate(self.phases):
            graphs[index]() if graphs else phase()
            marks.append(self._mark())
        slot, self.next_slot = self.next_slot, 1 - self.next_slot
        self.host[slot].copy_(self.packed, non_blocking=True)
        return Pending(slot, marks, self._mark())

    def collect(self, pending: Pending, stats) -> tuple[list[int], torch.Tensor | None]:
        """Wait for a launched step and read what it committed: (tokens, new hidden)."""
        if not isinstance(pending.done, float):
            pending.done.synchronize()  # this step only: a step launched after it may still run
        packed = self.host[pending.slot].tolist()
        accepted = packed[0]
        draft_s, verify_s = self._durations(pending.marks)
        stats.verify_steps += 1
        stats.accepted_per_step.append(accepted)
        stats.draft_time_s += draft_s
        stats.verify_time_s += verify_s
        return packed[1 : accepted + 2], self.hidden

    def capture(self, pool) -> None:
        """One CUDA graph per phase and width; each is replayed once so the next phase captures on
        real values (phases of one width replay in capture order, widths never interleave within a step)."""
        for width in self.widths:
            self.width, graphs = width, []
            for phase in self.phases:
                graphs.append(Graphed(phase, [], pool))
                graphs[-1].graph.replay()
            self.graphs[width] = graphs
            # keep this width's phase outputs alive, so no later capture reuses their memory
            self.held[width] = [
                getattr(self, name, None)
                for name in ("tokens", "parents", "depths", "accepted", "bonus", "new", "path_aux")
            ]
        torch.cuda.synchronize()

    def span(self, kv) -> int:
        """Cache slots attention reads this step: the step's width, within this cache."""
        return min(self.width, kv.max_len)

    def _mark(self):
        return mark(self.device)

    _durations = staticmethod(phase_seconds)

    # ------------------------------------------------------------ the device side (static shapes)

    def draft(self) -> None:
        """The EAGLE-2 tree of SpecDecoder.draft, greedy: -> self.tokens / parents / depths [size]."""
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        if self.drafter_run is None:
            self.tokens, self.parents, self.depths = self.root.clone(), zero, zero.clone()
            return
        if self.spec.topk == 1:
            return self.draft_chain()
        k, steps, run = self.spec.topk, self.spec.steps, self.drafter_run
        drafter, position = run.drafter, self.position
        columns = torch.arange(self.span(run.kv), device=self.device)
        prefix = columns < position
        tokens, parents, depths = [self.root], [zero], [zero.clone()]
        scores = [torch.zeros(1, device=self.device)]
        slot_of = torch.zeros(1 + k + (steps - 1) * k * k, dtype=torch.long, device=self.device)
        frontier, frontier_hidden, count = zero.clone(), self.hidden, 1
        for step in range(steps):
            if step > 0:  # the drafter on the frontier (nodes at depth `step`), k rows
                width = frontier.numel()
                slots = position + (step - 1) * k + torch.arange(width, device=self.device)
                slot_of = slot_of.index_copy(0, frontier, slots)
                every_parent = torch.cat(parents)
                lineage = [frontier]
                for _ in range(step - 1):
                    lineage.append(every_parent[lineage[-1]])
                ancestor_slots = slot_of[torch.stack(lineage, dim=1)]  # [width, step]
                mask = prefix[None] | (columns[None, :, None] == ancestor_slots[:, None, :]).any(
                    dim=-1
                )
                ids = torch.cat(tokens)[frontier]
                rows_position = (
                    position + (step - 1) + torch.zeros(width, dtype=torch.long, device=self.device)
                )
                frontier_hidden, logits = run._forward(
                    "step", ids, frontier_hidden, rows_position, slots, mask
                )
            else:
                logits = run.logits(self.hidden)
            base = torch.cat(scores)[frontier]
            log_probs, ids = top_children(logits, k, self.tree_temperature)
            child_tokens, child_scores = drafter.to_target_ids(ids), base[:, None] + log_probs
            per_row, width = child_tokens.shape[1], child_tokens.numel()
            tokens.append(child_tokens.reshape(-1))
            scores.append(child_scores.reshape(-1))
            parents.append(frontier[:, None].expand(-1, per_row).reshape(-1))
            depths.append(torch.full((width,), step + 1, dtype=torch.long, device=self.device))
            best = torch.sort(child_scores.reshape(-1), descending=True, stable=True).indices[:k]
            frontier_hidden = frontier_hidden[best // per_row]
            frontier = count + best
            count += width
        all_scores, all_parents = torch.cat(scores), torch.cat(parents)
        nodes = keep_best(all_scores, all_parents, self.spec.depth - 1)
        tree = subtree(nodes, torch.cat(tokens), all_parents, torch.cat(depths))
        self.tokens, self.parents, self.depths = tree.tokens, tree.parents, tree.depths

    def draft_chain(self) -> None:
        """topk = 1: the tree is a chain, node i at depth i in slot position + i - 1; each step sees
        the prefix and the slots before its own (no scores, lineage or selection to keep)."""
        run, position = self.drafter_run, self.position
        columns = torch.arange(self.span(run.kv), device=self.device)
        tokens, hidden = [self.root], self.hidden
        logits = run.logits(hidden)
        for step in range(self.spec.steps):
            if step > 0:
                slot = (position + (step - 1)).view(1)
                hidden, logits = run._forward(
                    "step", tokens[-1], hidden, slot, slot, (columns <= slot)[None]
                )
            tokens.append(run.drafter.to_target_ids(logits.argmax(dim=-1).view(1)))
        index = torch.arange(self.size, device=self.device)
        self.tokens, self.parents, self.depths = torch.cat(tokens), (index - 1).clamp_min(0), index

    def verify(self) -> None:
        """Target forward over the tree, greedy acceptance, the path's K/V to slots position..;
        -> self.accepted [1], self.bonus [1], self.new [max_commit] (committed tokens first), self.path_aux."""
        run, q, position = self.target_run, self.size, self.position
        index = torch.arange(q, device=self.device)
        ancestors = ancestor_mask(self.parents, self.spec.steps if self.spec.enabled else 0)
        columns = torch.arange(self.span(run.kv), device=self.device)
        relative = columns - position
        in_tree = (relative >= 0) & (relative < q)
        mask = (columns < position)[None] | (ancestors[:, relative.clamp(0, q - 1)] & in_tree[None])
        logits, aux = run._forward(
            self.tokens, position + self.depths, position + index, mask, compiled=run.compile_layers
        )
        argmax = logits.argmax(dim=-1)
        matches = (self.tokens == argmax[self.parents]) | (index == 0)
        accepted = ~(ancestors & ~matches[None, :]).any(dim=-1)
        depth_first = (
            self.depths * (q + 1) + (q - index) + 1
        ) * accepted - 1  # deepest first, then earliest
        best = depth_first.argmax(dim=0, keepdim=True)  # [1]: a 0-d index would be read on the host
        self.accepted, self.bonus = self.depths[best], argmax[best]
        path_first = torch.argsort(
            (~ancestors[best][0]).long() * q + index
        )  # path nodes in order, then the rest
        run.kv.keep(
            position, position + path_first
        )  # the rest lands past the commit: masked, then overwritten
        m = self.max_commit
        self.new = torch.where(
            index[:m] == self.accepted, self.bonus, self.tokens[path_first].roll(-1)[:m]
        )
        self.path_aux = aux[path_first[:m]]
        self.packed.copy_(torch.cat([self.accepted, self.new]))
        if self.drafter_run is None:
            self.commit()

    def extend(self) -> None:
        """The drafter's cache takes (aux of each accepted node, the token after it); rows past
        the path are causal-masked junk that the next step overwrites."""
        run, position = self.drafter_run, self.position
        rows = position + torch.arange(self.max_commit, device=self.device)
        mask = torch.arange(self.span(run.kv), device=self.device)[None, :] <= rows[:, None]
        hidden, _ = run._forward("extend", self.new, self.path_aux, rows, rows, mask)
        self.hidden.copy_(hidden.index_select(0, self.accepted))
        self.commit()

    def commit(self) -> None:
        self.root.copy_(self.bonus)
        self.position.add_(self.accepted[0] + 1)
