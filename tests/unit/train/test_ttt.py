"""TTT unroll: a brute-force chain-drafting reference, metric formulas, the two attention paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import ttt_case
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from eagle3.core.drafter import RMSNorm, sdpa
from eagle3.train.ttt import (
    compiled_soft_cross_entropy,
    soft_cross_entropy,
    step_metrics,
    tau_hat,
    ttt_loss,
    unroll,
)

DRAFT_VOCAB = 256
TTT = 4


@pytest.fixture
def case(make_cfg, tiny_target):
    return ttt_case(
        make_cfg("target=tiny-llama", f"drafter.draft_vocab_size={DRAFT_VOCAB}"), tiny_target
    )


def chain_draft(drafter, ids, aux, t: int, steps: int) -> list[torch.Tensor]:
    """What inference does: prefill the drafter on positions 0..t (causal), then draft a chain of
    `steps`-1 more tokens one at a time with a growing KV list, feeding the true next tokens.
    Returns the draft logits of each step at position t."""
    cache: dict[int, list[torch.Tensor]] = {}

    def prefill(layer, q, k, v):
        cache[layer] = [k, v]
        causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        return sdpa(q, k, v, causal)

    def decode(layer, q, k, v):
        cache[layer] = [torch.cat([cache[layer][0], k], 2), torch.cat([cache[layer][1], v], 2)]
        return sdpa(q, *cache[layer], None)

    hidden = drafter(
        ids[None, 1 : t + 2],
        drafter.project(aux[None, : t + 1]),
        torch.arange(t + 1)[None],
        prefill,
    )
    hidden = hidden[:, -1:]
    logits = [drafter.logits(hidden)[0, 0]]
    for k in range(1, steps):
        hidden = drafter(ids[None, t + k + 1 : t + k + 2], hidden, torch.tensor([[t + k]]), decode)
        logits.append(drafter.logits(hidden)[0, 0])
    return logits


@torch.no_grad()
def test_unroll_equals_chain_drafting(case):
    drafter, batch, _ = case
    step_logits = unroll(drafter, batch["input_ids"], batch["aux_hidden"], TTT)
    length = batch["input_ids"].shape[1]
    checked = 0
    for b in range(2):
        for t in range(length - TTT - 1):
            reference = chain_draft(drafter, batch["input_ids"][b], batch["aux_hidden"][b], t, TTT)
            for k in range(TTT):
                torch.testing.assert_close(step_logits[k][b, t], reference[k], atol=1e-5, rtol=1e-5)
                checked += 1
    assert checked == 2 * (length - TTT - 1) * TTT


@torch.no_grad()
def test_metrics_by_brute_force(case):
    drafter, batch, lm_head = case
    loss, counts = ttt_loss(drafter, batch, lm_head, TTT, step_decay=0.8)
    metrics = step_metrics(counts)
    step_logits = unroll(drafter, batch["input_ids"], batch["aux_hidden"], TTT)
    draft_to_target = torch.arange(DRAFT_VOCAB) + drafter.d2t
    ids, mask, last = batch["input_ids"], batch["loss_mask"], batch["last_hidden"]
    batch_size, length = ids.shape
    accuracies, expected_loss = [], 0.0
    for k in range(TTT):
        correct = count = 0
        ce_sum = 0.0
        for b in range(batch_size):
            for t in range(length):
                predicted = t + k + 2  # the token step k predicts at position t
                if predicted >= length or not mask[b, predicted]:
                    continue
                target_logits = last[b, t + k + 1] @ lm_head.t()
                target_token = int(target_logits.argmax())
                if not drafter.t2d[target_token]:
                    continue
                count += 1
                draft_token = int(draft_to_target[step_logits[k][b, t].argmax()])
                correct += draft_token == target_token
                probs = target_logits[draft_to_target].softmax(-1)
                ce_sum += float(-(probs * step_logits[k][b, t].log_softmax(-1)).sum())
        assert metrics[f"count_{k}"] == count and metrics[f"correct_{k}"] == correct
        assert metrics[f"acc_{k}"] == pytest.approx(correct / count)
        assert metrics[f"loss_{k}"] == pytest.approx(ce_sum / count, rel=1e-5)
        accuracies.append(correct / count)
        expected_loss += 0.8**k * ce_sum / count
    expected_tau, survive = 1.0, 1.0
    for acc in accuracies:
        survive *= acc
        expected_tau += survive
    assert metrics["tau_hat"] == pytest.approx(expected_tau)
    assert float(loss) == pytest.approx(expected_loss, rel=1e-5)
    # masking is exercised: some trained positions drop out because the target's argmax is outside
    assert 0 < metrics["count_0"] < int(mask[:, 2:].sum())


@torch.no_grad()
def test_head_metrics_by_brute_force(case):
    """acc_head_k: step k's predictions of the first HEAD trained tokens of each sequence, a target
    token outside the draft vocab counted as a miss; tau_hat_head from them."""
    drafter, batch, lm_head = case
    head = 4
    metrics = step_metrics(ttt_loss(drafter, batch, lm_head, TTT, 0.8, head_tokens=head)[1])
    plain = step_metrics(ttt_loss(drafter, batch, lm_head, TTT, step_decay=0.8)[1])
    assert "tau_hat_head" not in plain and plain["tau_hat"] == metrics["tau_hat"]
    step_logits = unroll(drafter, batch["input_ids"], batch["aux_hidden"], TTT)
    draft_to_target = torch.arange(DRAFT_VOCAB) + drafter.d2t
    ids, mask, last = batch["input_ids"], batch["loss_mask"], batch["last_hidden"]
    accuracies, out_of_vocab = [], 0
    for k in range(TTT):
        correct = count = 0
        for b in range(ids.shape[0]):
            for t in range(ids.shape[1]):
                predicted = t + k + 2
                if (
                    predicted >= ids.shape[1]
                    or not mask[b, predicted]
                    or mask[b, : predicted + 1].sum() > head
                ):
                    continue
                count += 1
                target_token = int((last[b, t + k + 1] @ lm_head.t()).argmax())
                out_of_vocab += not drafter.t2d[target_token]
                correct += int(draft_to_target[step_logits[k][b, t].argmax()]) == target_token
        assert (metrics[f"count_head_{k}"], metrics[f"correct_head_{k}"]) == (count, correct)
        accuracies.append(correct / count)
    assert metrics["tau_hat_head"] == pytest.approx(float(tau_hat(accuracies)))
    assert out_of_vocab > 0  # the misses the plain metric leaves out are exercised


def test_tau_hat_formula():
    assert float(tau_hat([1, 1, 1])) == 4.0
    assert float(tau_hat([0.5, 0.5])) == pytest.approx(1 + 0.5 + 0.25)
    assert float(tau_hat([0.0, 1.0, 1.0])) == 1.0


@torch.no_grad()
def test_flex_matches_sdpa_forward(case):
    """flex_attention has no CPU backward, so on CPU only values are compared; the GPU test
    below compares gradients."""
    drafter, batch, lm_head = case
    loss_sdpa, counts_sdpa = ttt_loss(drafter, batch, lm_head, TTT, 0.8, attention="sdpa")
    loss_flex, counts_flex = ttt_loss(drafter, batch, lm_head, TTT, 0.8, attention="flex")
    metrics_sdpa, metrics_flex = step_metrics(counts_sdpa), step_metrics(counts_flex)
    torch.testing.assert_close(loss_flex, loss_sdpa, atol=1e-5, rtol=1e-5)
    for key in metrics_sdpa:
        assert metrics_flex[key] == pytest.approx(metrics_sdpa[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("compiled", [False, True])
def test_soft_cross_entropy_matches_log_softmax_form(compiled):
    """logsumexp(x) - p.x equals -p.log_softmax(x) in value and gradient (p sums to 1), eager and
    through torch.compile (Inductor's CPU backend here), on two lengths and a strided view as the
    unroll's steps pass them (one compile, dynamic in the positions)."""
    cross_entropy = compiled_soft_cross_entropy() if compiled else soft_cross_entropy
    generator = torch.Generator().manual_seed(0)
    for length in (9, 5):
        logits = (
            (3 * torch.randn(2, length + 2, 64, generator=generator))
            .to(torch.bfloat16)
            .requires_grad_()
        )
        probs = torch.randn(2, length + 3, 64, generator=generator).softmax(-1)[:, 3:]
        weights = torch.rand(2, length, generator=generator)
        reference_logits = logits.detach().clone().requires_grad_()
        reference = -(probs * F.log_softmax(reference_logits[:, :length].float(), -1)).sum(-1)
        (reference * weights).sum().backward()
        value = cross_entropy(logits[:, :length], probs)
        (value * weights).sum().backward()
        torch.testing.assert_close(value, reference, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits.grad, reference_logits.grad)
        assert logits.grad[:, length:].abs().sum() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention backward needs a GPU")
def test_flex_matches_sdpa_gradients(case):
    drafter, batch, lm_head = case
    drafter = drafter.cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    grads = {}
    for path in ("sdpa", "flex"):
        drafter.zero_grad()
        loss, _ = ttt_loss(drafter, batch, lm_head.cuda(), TTT, 0.8, attention=path)
        loss.backward()
        grads[path] = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}
    for name, grad in grads["sdpa"].items():
        torch.testing.assert_close(grads["flex"][name], grad, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_llama(dtype):
    torch.manual_seed(0)
    ours, theirs = RMSNorm(48, eps=1e-5), LlamaRMSNorm(48, eps=1e-5)
    ours.weight.data.normal_()
    theirs.weight.data.copy_(ours.weight.data)
    x = (torch.randn(3, 5, 48) * 4).to(dtype)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)


def test_masked_sdpa_repeats_kv_heads_like_enable_gqa():
    """9 query heads over 3 KV heads with a mask: the repeated heads give enable_gqa's result."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 9, 5, 8), torch.randn(2, 3, 11, 8), torch.randn(2, 3, 11, 8)
    mask = torch.rand(5, 11) > 0.4
    mask[:, 0] = True
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(sdpa(q, k, v, mask), expected, rtol=1e-6, atol=1e-6)
