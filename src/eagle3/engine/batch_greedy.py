"""BatchDecoder's greedy steps kept on the device, at shapes CUDA graphs can replay.

A step is three phases over static buffers, as FusedGreedy's at batch 1: draft (every row's tree),
verify (the target over all trees, greedy acceptance as tensor algebra over each row's ancestor mask,
each accepted path's K/V moved to the front with one gather per cache) and extend (the drafter over
the committed tokens, padded to the most one step commits). The host writes the rows' roots,
positions and tree sizes before the step and reads one [B, 1 + max_commit] tensor after it.

With CUDA graphs the batch is padded to the first of the graph batch sizes that holds it and the
cache width to a power of two; each (batch size, width) is captured on its first use. The padding
rows are free cache rows: they decode position 0 and nothing reads what they write. Every phase
only reads what the host staged or an earlier phase wrote, so the warm-up runs of a capture repeat
the same step.
"""

from __future__ import annotations

import torch

from eagle3.engine.batch_forwards import (
    causal,
    counted_ancestors,
    permute_slots,
    target_forward,
    tree_mask,
)
from eagle3.engine.fused import mark, phase_seconds
from eagle3.engine.runners import Graphed


class BatchGreedySteps:
    def __init__(self, decoder, spec, batch_sizes: tuple[int, ...], static: bool, graphs: bool):
        """Steps of one spec (a decoder running a schedule holds one of these per shape; they share
        its caches). static: pad a batch to the first of batch_sizes (and max_batch_size) that holds
        it and the cache width to a power of two (False: the batch and the width the rows use).
        graphs: replay each static shape from a CUDA graph."""
        self.decoder, self.spec, self.device = decoder, spec, decoder.device
        top = decoder.max_batch_size
        self.sizes = sorted({b for b in batch_sizes if b < top} | {top}) if static else []
        self.q = spec.depth if spec.enabled else 1  # verified nodes per row (root included)
        self.max_commit = min(self.q, spec.steps + 1) if spec.enabled else 1
        # cache slots a step writes past a row's position: the tree, the draft frontier
        self.reach = max(self.q, spec.steps * spec.topk) if spec.enabled else 1
        end = decoder.max_context + self.reach
        self.widths = sorted({min(2**n, end) for n in range(8, max(8, (end - 1).bit_length()) + 1)})
        # what the host writes before a step: each row's root, position and tree size
        self.staged = torch.zeros(3, top, dtype=torch.long, device=self.device)
        self.packed = torch.zeros(top, 1 + self.max_commit, dtype=torch.long, device=self.device)
        self.hidden_in = None if decoder.hidden is None else torch.zeros_like(decoder.hidden)
        # the drafter's cache takes the committed tokens at spec=off steps too (when a schedule's
        # other shapes draft), so that any later step can draft from it
        extend = decoder.drafter is not None
        self.phases = [self.draft, self.verify] + ([self.extend] if extend else [])
        self.graphs: dict[tuple[int, int], list[Graphed]] = {}
        # each shape's phase outputs, kept alive so that no later capture reuses their memory
        self.held: dict[tuple[int, int], list] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self.shape = (0, 0)  # (rows, cache width) of the step being run

    def step(self, rows: list) -> tuple[list[list[int]], float, float]:
        """One greedy step over the requests in rows 0..len(rows)-1 -> (each row's committed tokens,
        draft + extend seconds, verify seconds)."""
        count = len(rows)
        positions = [r.position for r in rows]
        needed = max(positions) + self.reach
        if self.sizes:
            padded = next(b for b in self.sizes if b >= count)
            width = next(w for w in self.widths if w >= needed)
        else:
            padded, width = count, needed
        pad = [0] * (padded - count)
        staged = [
            [r.root for r in rows] + pad,
            positions + pad,
            self.decoder.tree_sizes(positions, self.spec) + [1] * len(pad),
        ]
        self.staged[:, :padded].copy_(torch.tensor(staged))
        if self.hidden_in is not None:
            self.hidden_in[:padded].copy_(self.decoder.hidden[:padded])
        self.shape = (padded, width)
        marks = self.run_phases()
        packed = self.packed[:count].tolist()
        committed = [row[1 : row[0] + 2] for row in packed]
        return committed, *phase_seconds(marks)

    def run_phases(self) -> list:
        graphs = self.graphs.get(self.shape)
        if self.pool is not None and graphs is None:
            return self.capture()
        marks = [mark(self.device)]
        for index, phase in enumerate(self.phases):
            graphs[index].graph.replay() if graphs else phase()
            marks.append(mark(self.device))
        return marks

    def capture(self) -> list:
        """This shape's phases captured in order, each replayed once (the step runs) so that the next
        one captures on real values."""
        graphs, marks = [], [mark(self.device)]
        for phase in self.phases:
            graphs.append(Graphed(phase, [], self.pool))
            graphs[-1].graph.replay()
            marks.append(mark(self.device))
        self.graphs[self.shape] = graphs
        self.held[self.shape] = [self.tokens, self.parents, self.depths, self.path_aux, self.new]
        return marks

    def span(self, kv) -> int:
        return min(self.shape[1], kv.max_len)

    # ------------------------------------------------------------ the device side

    def draft(self) -> None:
        """-> self.tokens / parents / depths [B, q]: every row's tree (its root alone with spec=off)."""
        decoder, (batch, _) = self.decoder, self.shape
        roots, position = self.staged[0, :batch], self.staged[1, :batch]
        if not self.spec.enabled:
            zero = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
            self.tokens, self.parents, self.depths = roots[:, None].clone(), zero, zero.clone()
            return
        trees = decoder.draft(
            roots,
            position,
            self.hidden_in[:batch],
            self.span(decoder.drafter_kv),
            sample=False,
            shape=self.spec,
        )
        self.tokens, self.parents, self.depths = trees.tokens, trees.parents, trees.depths

    def verify(self) -> None:
        """The target over every tree, greedy acceptance, each row's path K/V to slots position..
        -> self.packed [B, 1 + max_commit] (accepted count, committed tokens), self.new, self.path_aux."""
        decoder, (batch, _), q = self.decoder, self.shape, self.q
        position, sizes = self.staged[1, :batch], self.staged[2, :batch]
        index = torch.arange(q, device=self.device)
        ancestors, counted = counted_ancestors(self.parents, sizes, max(self.spec.steps, 0))
        mask = tree_mask(position, ancestors, self.span(decoder.target_kv))
        lean = decoder.target_lean
        positions = (position[:, None] + self.depths).clamp_max(lean.cos.shape[0] - 1)
        slots = position[:, None] + index
        rows = slice(0, batch)
        logits, aux = target_forward(
            lean, decoder.target_kv, rows, self.tokens, positions, slots, mask
        )
        argmax = logits.argmax(dim=-1)  # [B, q]
        matches = ((self.tokens == argmax.gather(1, self.parents)) | (index == 0)) & counted
        accepted = ~(ancestors & ~matches[:, None, :]).any(dim=-1)
        # siblings hold distinct tokens, so the accepted nodes are one chain: its deepest node ends it
        best = ((self.depths * (q + 1) + (q - index) + 1) * accepted).argmax(dim=1, keepdim=True)
        count, bonus = self.depths.gather(1, best), argmax.gather(1, best)  # [B, 1]
        on_path = ancestors.gather(1, best[:, :, None].expand(-1, 1, q))[:, 0]
        path_first = torch.argsort(
            (~on_path).long() * q + index, dim=1
        )  # path nodes, then the rest
        permute_slots(decoder.target_kv, batch, position, path_first)
        m = self.max_commit
        after = self.tokens.gather(1, path_first).roll(-1, dims=1)[:, :m]
        self.new = torch.where(index[:m] == count, bonus, after)
        self.path_aux = aux.gather(1, path_first[:, :m, None].expand(-1, -1, aux.shape[-1]))
        self.count = count
        self.packed[:batch].copy_(torch.cat([count, self.new], dim=1))

    def extend(self) -> None:
        """The drafter's cache takes (each accepted node's aux, the token after it); a row's slots
        past its commit are masked junk that its next step overwrites. -> decoder.hidden rows."""
        decoder, (batch, _) = self.decoder, self.shape
        position = self.staged[1, :batch]
        positions = position[:, None] + torch.arange(self.max_commit, device=self.device)
        mask = causal(positions, self.span(decoder.drafter_kv))
        hidden = decoder._extend(slice(0, batch), self.new, self.path_aux, positions, mask)
        last = hidden.gather(1, self.count[:, :, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
        decoder.hidden[:batch].copy_(last)
