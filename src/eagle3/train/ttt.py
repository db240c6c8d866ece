"""Training-time test (TTT): unroll the drafter over its own hidden states, as it drafts.

Shapes: B sequences of T tokens; the target's aux states `aux [B, T, 3H_t]` and final
hidden states `last [B, T, H_t]` (after the final norm) at every position t.

Step k (0-based) of the unroll, at position t:
  input token  ids[t + k + 1]          (the shifted input ids, true tokens)
  hidden       fc(aux[t]) for k = 0, else the drafter's own step-(k-1) output at t
  RoPE position position_ids[t] + k     (the slot this draft occupies at inference)
  predicts     token t + k + 2, against the target's distribution at position t + k + 1
  attends to   step-0 keys at positions <= t (the real prefix) plus its own keys from
               steps 1..k at position t (EAGLE-3's diagonal mask)

That is exactly what a chain draft of length k+1 from the prefix ending at t sees at
inference, for every t at once.

Loss of step k: soft cross-entropy between the drafter's distribution over the draft
vocab and the target's distribution restricted to the draft vocab (softmax over the
target logits of the draft-vocab tokens), averaged over valid positions: the predicted
token is a trained token (loss_mask) inside the sequence, and the target's argmax over
its full vocab lies in the draft vocab. Total loss = sum_k step_decay**k * loss_k.

Metrics: acc_k = fraction of valid positions where the draft argmax equals the target
argmax at step k; the simulated acceptance length (tokens per verify step with a chain
of ttt_length drafts, the verified token included)

    tau_hat = 1 + sum_k prod_{j<=k} acc_j

With head_tokens = N, acc_head_k and tau_hat_head score the same predictions the way a decode of N
new tokens meets them: only the first N trained tokens of each sequence (greedy regenerations
loop, and their long tails are easy), and a token outside the draft vocab counts as a miss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.core.drafter import Eagle3Drafter, sdpa

ATTENTION_PATHS = ("sdpa", "flex")


# ---------------------------------------------------------------- target side


@dataclass
class TargetDistribution:
    probs: torch.Tensor  # [B, T, D] target's softmax over the draft vocab (float32)
    argmax: torch.Tensor  # [B, T] draft id of the target's argmax
    in_vocab: torch.Tensor  # [B, T] bool: the target's full-vocab argmax is in the draft vocab


@torch.no_grad()
def target_distribution(
    last_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    chunk: int = 1024,
) -> TargetDistribution:
    """The target's next-token distribution restricted to the draft vocab, position by position
    (in chunks of positions, so the full-vocab logits never exist for the whole batch at once)."""
    draft_to_target = torch.arange(d2t.numel(), device=d2t.device) + d2t
    flat = last_hidden.reshape(-1, last_hidden.shape[-1])
    head = lm_head_weight.float().t()
    probs, argmax, in_vocab = [], [], []
    for rows in flat.split(chunk):
        logits = rows.float() @ head
        in_vocab.append(t2d[logits.argmax(-1)])
        draft_logits = logits[:, draft_to_target]
        probs.append(draft_logits.softmax(-1))
        argmax.append(draft_logits.argmax(-1))
    shape = last_hidden.shape[:-1]
    return TargetDistribution(
        torch.cat(probs).view(*shape, -1),
        torch.cat(argmax).view(shape),
        torch.cat(in_vocab).view(shape),
    )


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t + n] at position t along dim 1, `fill` past the end."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1) if n < x.shape[1] else torch.full_like(x, fill)


# ---------------------------------------------------------------- attention over unroll steps


def ttt_mask(length: int, steps: int, device) -> torch.Tensor:
    """Bool [T, steps*T]: query t sees step-0 keys <= t and key t of each later step."""
    positions = torch.arange(length, device=device)
    causal = positions[None, :] <= positions[:, None]
    diagonal = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * (steps - 1), dim=1)


_compiled_flex = None


def flex(q, k, v, length: int, steps: int) -> torch.Tensor:
    """The same mask through flex_attention (compiled on GPU: scores never materialized)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask_mod(_b, _h, q_idx, kv_idx):
        step, pos = kv_idx // length, kv_idx % length
        return ((step == 0) & (pos <= q_idx)) | ((step > 0) & (pos == q_idx))

    block_mask = create_block_mask(
        mask_mod, B=None, H=None, Q_LEN=length, KV_LEN=steps * length, device=q.device
    )
    run = flex_attention
    if q.device.type == "cuda":
        # default (automatic) dynamic shapes: the KV length grows every unroll step and T varies
        # by batch; dynamic=False would recompile per shape and fall back to eager past the limit
        _compiled_flex = _compiled_flex or torch.compile(flex_attention)
        run = _compiled_flex
    return run(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


class UnrollAttention:
    """The drafter's `attend` callback for the unroll: per layer, the keys/values of every
    step so far, concatenated step-major ([step0 t0..tT-1, step1 t0..tT-1, ...])."""

    def __init__(self, length: int, path: str):
        if path not in ATTENTION_PATHS:
            raise ValueError(f"attention path {path!r}: use one of {ATTENTION_PATHS}")
        self.length, self.path = length, path
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}

    def __call__(self, layer: int, q, k, v) -> torch.Tensor:
        self.keys.setdefault(layer, []).append(k)
        self.values.setdefault(layer, []).append(v)
        steps = len(self.keys[layer])
        keys, values = torch.cat(self.keys[layer], dim=2), torch.cat(self.values[layer], dim=2)
        if self.path == "flex":
            return flex(q, keys, values, self.length, steps)
        return sdpa(q, keys, values, ttt_mask(self.length, steps, q.device))


def unroll(
    drafter: Eagle3Drafter,
    input_ids,
    aux_hidden,
    ttt_length: int,
    attention: str = "sdpa",
    position_ids=None,
) -> list[torch.Tensor]:
    """Draft logits [B, T, D] of each unroll step (see the module docstring)."""
    batch, length = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)
    attend = UnrollAttention(length, attention)
    hidden = drafter.project(aux_hidden.to(drafter.fc.weight.dtype))
    step_logits = []
    for k in range(ttt_length):
        hidden = drafter(shift_left(input_ids, k + 1), hidden, position_ids + k, attend)
        step_logits.append(drafter.logits(hidden))
    return step_logits


# ---------------------------------------------------------------- loss and metrics


def step_targets(target: TargetDistribution, loss_mask: torch.Tensor, k: int):
    """(probs, argmax, valid) for step k at positions t < T-k-1 (later ones predict past the end):
    the target at t+k+1 (views, not copies), valid where the predicted token t+k+2 is trained and
    the target's argmax there lies in the draft vocab."""
    count = loss_mask.shape[1] - (k + 1)
    valid = shift_left(loss_mask.bool(), k + 2, fill=False)[:, :count] & target.in_vocab[:, k + 1 :]
    return target.probs[:, k + 1 :], target.argmax[:, k + 1 :], valid


def tau_hat(accuracies: list[float] | torch.Tensor) -> torch.Tensor:
    """Simulated acceptance length: 1 + sum_k prod_{j<=k} acc_j."""
    acc = torch.as_tensor(accuracies, dtype=torch.float64)
    return 1 + torch.cumprod(acc, dim=0).sum()


def ttt_loss(
    drafter: Eagle3Drafter,
    batch: dict,
    target_lm_head_weight: torch.Tensor,
    ttt_length: int,
    step_decay: float,
    attention: str = "sdpa",
    head_tokens: int | None = None,
    compile_loss: bool = False,
    compile_unroll: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted loss, per-step counts) for one batch of {input_ids, loss_mask, aux_hidden,
    last_hidden}, with no read to the host: counts is a float32 tensor [ttt_length, 3] of (loss_k,
    correct_k, count_k) per step on the batch's device, [ttt_length, 5] with head_tokens (correct_head_k,
    count_head_k appended; module docstring); step_metrics reads them to the host as metrics.
    compile_loss runs the soft cross-entropy torch.compile'd (see soft_cross_entropy), compile_unroll
    the unroll of training batches of two or more rows (see compiled_unroll)."""
    cross_entropy = compiled_soft_cross_entropy() if compile_loss else soft_cross_entropy
    # validation (no grad) and a batch of one run eager: each is a guard of the compiled graph, so each
    # would cost a compile of its own (minutes on a GPU, at every start of a resumed run)
    compiled = compile_unroll and torch.is_grad_enabled() and batch["input_ids"].shape[0] > 1
    run_unroll = compiled_unroll() if compiled else unroll
    target = target_distribution(
        batch["last_hidden"], target_lm_head_weight, drafter.d2t, drafter.t2d
    )
    step_logits = run_unroll(
        drafter,
        batch["input_ids"],
        batch["aux_hidden"],
        ttt_length,
        attention,
        batch.get("position_ids"),
    )
    trained = batch["loss_mask"].bool()
    head = trained & (trained.long().cumsum(1) <= head_tokens) if head_tokens else None
    total = 0.0
    per_step = []
    for k, logits in enumerate(step_logits):
        probs, argmax, valid = step_targets(target, batch["loss_mask"], k)
        logits = logits[:, : valid.shape[1]]
        count = valid.sum()
        loss_k = (cross_entropy(logits, probs) * valid).sum() / count.clamp(min=1)
        hits = logits.argmax(-1) == argmax
        row = [loss_k.detach().float(), (hits & valid).sum().float(), count.float()]
        if head is not None:  # out-of-vocab positions stay in, as misses
            scored = shift_left(head, k + 2, fill=False)[:, : valid.shape[1]]
            row += [
                (hits & scored & target.in_vocab[:, k + 1 :]).sum().float(),
                scored.sum().float(),
            ]
        total = total + step_decay**k * loss_k
        per_step.append(torch.stack(row))
    return total, torch.stack(per_step)


def tau_hat_on_device(correct: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """tau_hat from per-step correct and count tensors, computed where they are (no host read)."""
    accuracies = correct / count.clamp(min=1)
    return 1 + torch.cumprod(accuracies, dim=0).sum()


def step_metrics(counts: torch.Tensor) -> dict:
    """ttt_loss's per-step counts read to the host once, as metrics: loss_k, acc_k (floats, per
    step), correct_k / count_k (counts, for exact aggregation across batches and ranks), tau_hat;
    with head_tokens also acc_head_k, correct_head_k / count_head_k and tau_hat_head."""
    per_step, ttt_length = counts.tolist(), counts.shape[0]
    metrics: dict[str, float] = {}
    for k, (loss_k, correct, count, *head_counts) in enumerate(per_step):
        metrics.update(
            {
                f"loss_{k}": loss_k,
                f"acc_{k}": correct / max(count, 1),
                f"correct_{k}": int(correct),
                f"count_{k}": int(count),
            }
        )
        if head_counts:
            metrics.update(
                {
                    f"acc_head_{k}": head_counts[0] / max(head_counts[1], 1),
                    f"correct_head_{k}": int(head_counts[0]),
                    f"count_head_{k}": int(head_counts[1]),
                }
            )
    metrics["tau_hat"] = tau_hat([metrics[f"acc_{k}"] for k in range(ttt_length)]).item()
    if per_step and len(per_step[0]) > 3:
        metrics["tau_hat_head"] = tau_hat(
            [metrics[f"acc_head_{k}"] for k in range(ttt_length)]
        ).item()
    return metrics


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Per position: -sum_v p_target(v) log p_draft(v), written as logsumexp(logits) - sum_v p(v) logits(v)
    (the target's probabilities sum to 1): no log-softmax tensor, and compiled it is one reduction
    over [positions, draft vocab] forward and one elementwise pass (softmax - p) backward, where the
    eager form writes and rereads several float32 copies of the logits."""
    logits = logits.float()
    return torch.logsumexp(logits, -1) - (probs * logits).sum(-1)


_compiled_soft_cross_entropy = None


def compiled_soft_cross_entropy():
    """soft_cross_entropy through torch.compile, dynamic in the positions (each unroll step and batch
    has its own length)."""
    global _compiled_soft_cross_entropy
    if _compiled_soft_cross_entropy is None:
        _compiled_soft_cross_entropy = torch.compile(soft_cross_entropy, dynamic=True)
    return _compiled_soft_cross_entropy


_compiled_unroll = None


def compiled_unroll():
    """unroll through torch.compile, dynamic in the batch and the length: the drafter's steps (and their
    backward) as fused kernels, where eager launches a few hundred small ones per batch."""
    global _compiled_unroll
    if _compiled_unroll is None:
        _compiled_unroll = torch.compile(unroll, dynamic=True)
    return _compiled_unroll
