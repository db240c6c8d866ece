"""The embedded speculative decoder: lossless greedy (chain and tree), distribution-preserving
sampling, context limits, stop tokens, statistics and measured acceptance."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import FALSE_ALARM, PROMPTS, chi_square_p_value, reference_greedy, spec

from eagle3.core.common import Eagle3Error
from eagle3.core.drafter import build_drafter
from eagle3.engine import (
    ContextOverflow,
    DecodeRequest,
    RequestStats,
    SpecDecoder,
    measure_acceptance,
    summarize,
)
from eagle3.engine.options import DecoderOptions
from eagle3.engine.sampling import sampled_path

NEW_TOKENS = 40
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest


@pytest.fixture(scope="module")
def tiny_cfg(test_root):
    from eagle3.core.common import compose

    return compose([f"paths.root={test_root}", "target=tiny-llama"])


@pytest.fixture(scope="module")
def untrained(tiny_target, tiny_cfg):
    torch.manual_seed(0)
    return build_drafter(tiny_target, tiny_cfg.drafter).eval()


@pytest.fixture(scope="module")
def fitted(tiny_fitted_drafter):
    return tiny_fitted_drafter


@pytest.fixture(scope="module")
def references(tiny_target):
    prompts = [tiny_target.tokenizer(text)["input_ids"] for text in PROMPTS]
    return [(p, reference_greedy(tiny_target.model, p, NEW_TOKENS)) for p in prompts]


def greedy_results(references, *decoders):
    """Each decoder's result on each reference prompt (a tuple per prompt, decoded in the order
    given), after checking that every one commits the target's own greedy decode."""
    for prompt, expected in references:
        results = tuple(d.generate(DecodeRequest(prompt, NEW_TOKENS)) for d in decoders)
        assert [r.tokens for r in results] == [expected] * len(decoders)
        yield results


def assert_same_steps(references, first, second) -> None:
    """Both decoders commit the target's greedy decode with the same acceptance, step for step."""
    for a, b in greedy_results(references, first, second):
        assert a.stats.accepted_per_step == b.stats.accepted_per_step


@pytest.mark.parametrize("name", ["off", "d2", "d6", "d8s4k3", "d10s5k4"])
def test_greedy_is_lossless_untrained_drafter(tiny_target, untrained, references, name):
    decoder = SpecDecoder(tiny_target, untrained, spec(name))
    for (result,) in greedy_results(references, decoder):
        assert result.finish_reason == "length" and result.stats.completion_tokens == NEW_TOKENS


@pytest.mark.parametrize("name", ["d2", "d6", "d8s4k3", "d10s5k4"])
def test_greedy_is_lossless_fitted_drafter(tiny_target, fitted, references, name):
    """With a drafter that gets accepted, paths of several tokens are committed (cache gathers,
    drafter extends) and the output is still the target's greedy decode."""
    decoder = SpecDecoder(tiny_target, fitted, spec(name))
    accepted = []
    for (result,) in greedy_results(references, decoder):
        accepted += result.stats.accepted_per_step
    assert max(accepted) >= min(2, spec(name).depth - 1) and sum(accepted) > len(accepted) // 2


@pytest.mark.parametrize("name", ["off", "d2", "d6", "d8s4k3", "d10s5k4"])
def test_fused_steps_match_step_by_step(tiny_target, fitted, references, name):
    """The device-side greedy step (static shapes, one host read; what the CUDA graphs replay)
    commits exactly what the step-by-step path commits, step for step."""
    fused, plain = (
        SpecDecoder(tiny_target, fitted, spec(name)),
        SpecDecoder(tiny_target, fitted, spec(name), DecoderOptions(fused=False)),
    )
    assert fused.fused is not None and plain.fused is None
    for a, b in greedy_results(references, fused, plain):
        assert a.stats.accepted_per_step == b.stats.accepted_per_step
        assert a.stats.verify_steps == b.stats.verify_steps and a.stats.draft_time_s > 0


@pytest.mark.parametrize("name", ["off", "d6", "d10s5k4"])
def test_overlapped_steps_commit_the_same_and_waste_at_most_one(
    tiny_target, fitted, references, name, monkeypatch
):
    """engine.overlap_steps: each fused step is launched before the last one is read. Same tokens and
    acceptance as one step at a time; a generation that ends on its budget launches exactly the steps it
    counts, one that ends on a stop token at most one more; a context that ends mid-way leaves the
    look-ahead out (its steps would not fit) and finishes on plain steps."""
    from eagle3.engine.fused import FusedGreedy

    launched, from_host = [], []  # every step launched; those launched from the host's state
    launch, launch_next = FusedGreedy.launch, FusedGreedy.launch_next
    monkeypatch.setattr(
        FusedGreedy,
        "launch_next",
        lambda self, bound: launched.append(bound) or launch_next(self, bound),
    )
    monkeypatch.setattr(
        FusedGreedy, "launch", lambda self, *args: from_host.append(1) or launch(self, *args)
    )
    overlapped = SpecDecoder(tiny_target, fitted, spec(name))
    serial = SpecDecoder(tiny_target, fitted, spec(name), DecoderOptions(overlap_steps=False))
    for prompt, expected in references:
        b = serial.generate(DecodeRequest(prompt, NEW_TOKENS))
        launched.clear(), from_host.clear()
        a = overlapped.generate(DecodeRequest(prompt, NEW_TOKENS))
        assert (
            a.tokens == b.tokens == expected
            and a.stats.accepted_per_step == b.stats.accepted_per_step
        )
        assert (
            len(launched) == a.stats.verify_steps and len(from_host) < len(launched) // 2
        )  # the rest ran ahead
        launched.clear()
        stop = expected[NEW_TOKENS // 2]
        a = overlapped.generate(DecodeRequest(prompt, NEW_TOKENS, stop_ids=[stop]))
        assert a.tokens == expected[: expected.index(stop) + 1]
        assert a.stats.verify_steps <= len(launched) <= a.stats.verify_steps + 1
    short = SpecDecoder(
        tiny_target, fitted, spec(name), DecoderOptions(max_context=len(references[0][0]) + 12)
    )
    assert (
        short.generate(DecodeRequest(references[0][0], NEW_TOKENS)).tokens == references[0][1][:12]
    )


@pytest.mark.parametrize("fused", [True, False])
def test_every_chain_draft_is_the_unrolls_step(tiny_target, fitted, references, fused, monkeypatch):
    """What the drafter sees at inference is what training showed it, at every depth: in a chain
    drafted from root position p, draft k (0-based) equals the TTT unroll's step-k argmax at
    position p - 1 of the committed sequence, wherever drafts 0..k-1 were the committed tokens
    (the unroll feeds true tokens). A wrong aux state, RoPE position or cache entry, at the first
    draft or a later one, changes it, and lossless tests cannot see it."""
    from eagle3.engine.fused import FusedGreedy
    from eagle3.train.ttt import unroll

    chains = []
    if fused:
        draft_chain = FusedGreedy.draft_chain

        def recording_chain(self):
            draft_chain(self)
            chains.append((int(self.position), self.tokens.tolist()))

        monkeypatch.setattr(FusedGreedy, "draft_chain", recording_chain)
    else:
        draft = SpecDecoder.draft

        def recording_draft(self, root, position, h_last, sampling):
            tree = draft(self, root, position, h_last, sampling)
            chains.append((position, tree.tokens.tolist()))
            return tree

        monkeypatch.setattr(SpecDecoder, "draft", recording_draft)
    decoder = SpecDecoder(tiny_target, fitted, spec("d4"), DecoderOptions(fused=fused))
    checked, drafted_steps = [0] * decoder.spec.steps, 0
    for prompt, expected in references:
        chains.clear()
        assert decoder.generate(DecodeRequest(prompt, NEW_TOKENS)).tokens == expected
        sequence = prompt + expected
        aux, _ = tiny_target.capture(torch.tensor([sequence]))
        with torch.no_grad():
            steps = unroll(fitted, torch.tensor([sequence]), aux, decoder.spec.steps)
        argmax = [fitted.to_target_ids(logits[0].argmax(-1)).tolist() for logits in steps]
        drafted_steps += len(chains)
        for position, chain in chains:
            for k, drafted in enumerate(chain[1:]):
                assert drafted == argmax[k][position - 1], (position, k)
                checked[k] += 1
                if position + k + 1 >= len(sequence) or drafted != sequence[position + k + 1]:
                    break
    assert checked[0] == drafted_steps > len(references)
    assert all(count > 0 for count in checked), checked


@pytest.mark.parametrize("fused", [True, False])
def test_lean_forward_off_gives_the_same_tokens(tiny_target, fitted, references, fused):
    """The lean Llama forward is on by default; lean=False runs HF's forward and commits the
    same tokens, step for step (float32)."""
    lean = SpecDecoder(tiny_target, fitted, spec("d8s4k3"), DecoderOptions(fused=fused))
    plain = SpecDecoder(
        tiny_target, fitted, spec("d8s4k3"), DecoderOptions(fused=fused, lean=False)
    )
    assert lean.target_run.lean is not None and plain.target_run.lean is None
    assert_same_steps(references, lean, plain)


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("eager_cudnn", [False, True])
def test_prefill_attention_leaves_cudnn_out(
    tiny_target, fitted, references, monkeypatch, lean, eager_cudnn
):
    """Forwards outside CUDA graphs (a prefill: the target's and the drafter's) run sdpa with
    cuDNN attention disabled, unless eager_cudnn; the flag is torch's own again afterwards.
    (A CPU machine cannot run cuDNN; the test reads the backend flag each sdpa call sees.)"""
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    decoder = SpecDecoder(
        tiny_target,
        fitted,
        spec("d6s3k2"),
        DecoderOptions(lean=lean, eager_cudnn=eager_cudnn, draft_attention="sdpa"),
    )  # the drafter's layer through sdpa too (the default is explicit)
    prompt, expected = references[0]
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)  # torch's default, whatever earlier tests left
    try:
        # the prefill's root token only: no verify step
        result = decoder.generate(DecodeRequest(prompt, 1))
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    layers = tiny_target.config.num_hidden_layers + fitted.config.num_hidden_layers
    assert result.tokens == expected[:1] and result.stats.verify_steps == 0
    assert seen == [eager_cudnn] * layers


@pytest.mark.parametrize("fused", [True, False])
def test_padded_prefill_commits_the_same(tiny_target, fitted, references, fused):
    """Prefill graphs pad a prompt to a captured width; the padding's K/V land in cache slots past
    the prompt that nothing attends to before they are rewritten, so the tokens and acceptance equal
    an unpadded prefill's (the padded prefill runs eagerly here: a CPU has no graphs)."""
    plain = SpecDecoder(tiny_target, fitted, spec("d6s3k2"), DecoderOptions(fused=fused))
    padded = SpecDecoder(tiny_target, fitted, spec("d6s3k2"), DecoderOptions(fused=fused))
    padded.prefill_widths = [64]
    assert all(len(prompt) < 64 for prompt, _ in references)
    assert_same_steps(references, padded, plain)


def test_fused_steps_across_cache_widths(tiny_target, fitted):
    """Attention reads a power-of-two window of the caches; a generation that crosses 256 slots
    switches windows mid-way and still commits what the step-by-step path commits."""
    prompt = list(range(1000, 1240))
    for name in ["d6", "d10s5k4"]:
        fused, plain = (
            SpecDecoder(tiny_target, fitted, spec(name)),
            SpecDecoder(tiny_target, fitted, spec(name), DecoderOptions(fused=False)),
        )
        a, b = fused.generate(DecodeRequest(prompt, 30)), plain.generate(DecodeRequest(prompt, 30))
        assert a.tokens == b.tokens and a.stats.accepted_per_step == b.stats.accepted_per_step
        assert fused.fused.widths[:2] == [256, 512] and fused.fused.width == 512


HOST_READS = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "masked_select",
    "is_nonzero",
    "equal",
    "_unique2",
}


@pytest.mark.parametrize("name", ["off", "d6", "d10s5k4"])
def test_fused_phases_are_graph_safe(tiny_target, untrained, references, name):
    """What a CUDA graph can replay: no op in the fused phases reads a value on the host or makes
    a data-dependent shape, and no tensor moves between devices."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bad = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name in HOST_READS or (name == "_to_copy" and "device" in (kwargs or {})):
                self.bad.append(name)
            return func(*args, **(kwargs or {}))

    decoder = SpecDecoder(tiny_target, untrained, spec(name))
    prompt, _ = references[0]
    decoder.generate(DecodeRequest(prompt, 3))
    fused = decoder.fused
    fused.root.fill_(prompt[-1])
    fused.position.fill_(len(prompt))
    watch = Watch()
    with torch.inference_mode(), watch:
        for phase in fused.phases:
            phase()
    assert watch.bad == []
    assert (
        int(fused.position) == len(prompt) + int(fused.accepted[0]) + 1
        and fused.root.tolist() == fused.bonus.tolist()
    )
    caught = Watch()
    with caught:  # the mistake it guards against: a 0-d tensor index is read on the host
        torch.arange(4)[torch.tensor(2)]
    assert caught.bad == ["_local_scalar_dense"]


def test_full_tree_accepts_at_least_the_chain(tiny_target, fitted, references):
    """A tree that keeps every candidate contains the chain's drafts, so it accepts no less."""
    from engine_helpers import SPECS

    SPECS["d5"], SPECS["all_s4k3"] = (
        dict(enabled=True, depth=5, steps=None, topk=1),
        dict(enabled=True, depth=1 + 3 + 3 * 9, steps=4, topk=3),
    )
    chain, tree = (
        SpecDecoder(tiny_target, fitted, spec("d5")),
        SpecDecoder(tiny_target, fitted, spec("all_s4k3")),
    )
    for a, b in greedy_results(references, chain, tree):
        assert b.stats.verify_steps <= a.stats.verify_steps


def test_stop_ids_and_on_tokens(tiny_target, fitted, references):
    prompt, expected = references[0]
    decoder = SpecDecoder(tiny_target, fitted, spec("d6"))
    stop = expected[7]
    first = expected.index(stop)
    result = decoder.generate(DecodeRequest(prompt, NEW_TOKENS, stop_ids=[stop]))
    assert result.tokens == expected[: first + 1] and result.finish_reason == "stop"
    seen = []
    result = decoder.generate(
        DecodeRequest(prompt, NEW_TOKENS, on_tokens=lambda new: seen.extend(new) or len(seen) >= 10)
    )
    assert (
        result.finish_reason == "stop"
        and result.tokens == seen == expected[: len(seen)]
        and len(seen) >= 10
    )
    seen = []  # a step that commits past max_new_tokens: on_tokens sees only what the result keeps
    result = decoder.generate(
        DecodeRequest(prompt, 10, on_tokens=lambda new: seen.extend(new) or False)
    )
    assert (
        1 + sum(a + 1 for a in result.stats.accepted_per_step) > 10
        and seen == result.tokens == expected[:10]
    )


def test_request_generator_reproduces_and_leaves_the_running_one(tiny_target, fitted, references):
    prompt, _ = references[0]
    decoder = SpecDecoder(tiny_target, fitted, spec("d8s4k3"), DecoderOptions(seed=0))
    state = decoder.generator.get_state()
    draw = lambda seed: (
        decoder.generate(
            DecodeRequest(
                prompt, 12, temperature=1.0, generator=torch.Generator().manual_seed(seed)
            )
        ).tokens
    )
    assert draw(5) == draw(5) != draw(6)
    assert torch.equal(decoder.generator.get_state(), state)


def test_context_limits(tiny_target, fitted, references):
    prompt, expected = references[0]
    decoder = SpecDecoder(
        tiny_target, fitted, spec("d10s5k4"), DecoderOptions(max_context=len(prompt) + 12)
    )
    # the tree no longer fits near the end: plain steps
    result = decoder.generate(DecodeRequest(prompt, NEW_TOKENS))
    assert result.tokens == expected[:12] and result.finish_reason == "length"
    with pytest.raises(ContextOverflow, match=f"context holds {len(prompt) + 12}"):
        decoder.generate(DecodeRequest(list(range(1, len(prompt) + 13)), 4))
    with pytest.raises(Eagle3Error, match="empty prompt"):
        decoder.generate(DecodeRequest([], 4))
    with pytest.raises(Eagle3Error, match="needs a drafter"):
        SpecDecoder(tiny_target, None, spec("d6"))


@pytest.mark.parametrize("n,k", [(32768, 8), (32768, 16), (49152, 1), (1000, 3), (7, 7)])
def test_top_children_are_a_stable_sorts_first_k(n, k):
    """tree.top_k (two rounds of short sorts) equals a full stable descending sort's first k, ties
    to the lower index, on rows full of ties; top_children's scores are the log-softmax's values."""
    from eagle3.engine.tree import top_children, top_k

    generator = torch.Generator().manual_seed(n + k)
    rows = torch.randn(6, n, generator=generator).bfloat16().float()  # bf16 logits: many exact ties
    rows[0] = 1.0  # one row all tied
    rows[1, n // 2 :] = rows[1, : n - n // 2].clone()  # values repeated, far apart
    rows[2, : n // 3] = -1e30  # a stretch far below the rest, all tied
    values, indices = top_k(rows, k)
    reference = torch.sort(rows, dim=-1, descending=True, stable=True)
    assert torch.equal(indices, reference.indices[:, :k]) and torch.equal(
        values, reference.values[:, :k]
    )
    log_probs, ids = top_children(rows, k)
    assert torch.equal(ids, indices)
    assert torch.allclose(log_probs, torch.log_softmax(rows, dim=-1).gather(-1, indices), atol=1e-5)
    for temperature in (0.5, 2.0):  # the tree temperature rescales the scores, never the choice
        log_probs, ids = top_children(rows, k, temperature)
        assert torch.equal(ids, indices)
        assert torch.allclose(
            log_probs, torch.log_softmax(rows / temperature, dim=-1).gather(-1, indices), atol=1e-5
        )


def test_tree_temperature_changes_the_trees_not_the_tokens(tiny_target, fitted, references):
    """engine.tree_temperature: other node scores keep other trees and still commit the target's greedy
    decode, the fused and the step-by-step path alike (same acceptance per step); a temperature <= 0 is refused."""
    trees = {}
    for temperature in (1.0, 0.25, 16.0):
        fused, plain = (
            SpecDecoder(
                tiny_target,
                fitted,
                spec("d10s5k4"),
                DecoderOptions(fused=f, tree_temperature=temperature),
            )
            for f in (True, False)
        )
        drafted = []
        draft = plain.draft
        plain.draft = lambda *args: drafted.append(draft(*args)) or drafted[-1]  # noqa: B023
        assert_same_steps(references, fused, plain)
        trees[temperature] = [sorted(zip(t.depths.tolist(), t.tokens.tolist())) for t in drafted]
    changed = {t: sum(a != b for a, b in zip(trees[t], trees[1.0])) for t in (0.25, 16.0)}
    assert changed[0.25] > 0 and changed[16.0] > 0, changed
    for bad in (0, -1.0):
        with pytest.raises(Eagle3Error, match=f"engine.tree_temperature={bad!r}: must be > 0"):
            SpecDecoder(tiny_target, fitted, spec("d10s5k4"), DecoderOptions(tree_temperature=bad))


@pytest.mark.parametrize("fused", [True, False])
def test_draft_attention_explicit_and_sdpa_commit_the_same(tiny_target, fitted, references, fused):
    """engine.draft_attention: the drafter's explicit attention (the default) and sdpa draft the same
    trees here: the same tokens and the same acceptance, step for step."""
    explicit = SpecDecoder(tiny_target, fitted, spec("d10s5k4"), DecoderOptions(fused=fused))
    sdpa = SpecDecoder(
        tiny_target, fitted, spec("d10s5k4"), DecoderOptions(fused=fused, draft_attention="sdpa")
    )
    assert (
        explicit.drafter_run.lean.explicit_attention
        and not sdpa.drafter_run.lean.explicit_attention
    )
    with pytest.raises(Eagle3Error, match="engine.draft_attention='flash'"):
        SpecDecoder(tiny_target, fitted, spec("d10s5k4"), DecoderOptions(draft_attention="flash"))
    assert_same_steps(references, explicit, sdpa)


def test_explicit_draft_attention_matches_sdpa(fitted):
    """LeanDrafter's softmax(QK^T)V equals sdpa's output on a masked step (float32, 1e-5)."""
    from eagle3.engine.kv import DrafterKV
    from eagle3.engine.llama import LeanDrafter

    config, outputs = fitted.config, []
    for explicit in (False, True):
        lean, kv = (
            LeanDrafter(fitted, 32, explicit),
            DrafterKV(config, 32, torch.float32, torch.device("cpu")),
        )
        kv.buffer.normal_(generator=torch.Generator().manual_seed(1))
        kv.prepare(torch.arange(10, 13), 16)
        positions = torch.tensor([10, 11, 12])
        mask = torch.arange(16)[None, :] <= positions[:, None]
        hidden = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(2))
        outputs.append(lean.forward(torch.tensor([3, 5, 7]), hidden, positions, kv, mask))
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5) and not torch.equal(outputs[0], hidden)


def test_stats_arithmetic():
    a = RequestStats(
        prompt_tokens=5,
        completion_tokens=11,
        verify_steps=4,
        accepted_per_step=[3, 0, 2, 1],
        draft_tokens_per_step=3,
    )
    assert a.tau == 11 / 4 and a.accepted_per_position == [3, 2, 1]
    assert a.as_dict()["accepted_tokens"] == 6 and a.as_dict()["draft_tokens"] == 12
    b = RequestStats(
        prompt_tokens=2,
        completion_tokens=3,
        verify_steps=2,
        accepted_per_step=[1, 0],
        draft_tokens_per_step=3,
    )
    total = summarize([a, b])
    assert total["tau"] == 14 / 6 and total["accepted_tokens"] == 7
    assert total["acceptance_per_position"] == [4 / 6, 2 / 6, 1 / 6]


def test_measure_acceptance(tiny_target, fitted, references):
    prompts = [p for p, _ in references]
    result = measure_acceptance(tiny_target, fitted, prompts, spec("d6"), NEW_TOKENS)
    assert result["requests"] == len(prompts)
    assert result["tau"] == pytest.approx(result["completion_tokens"] / result["verify_steps"])
    assert result["tau"] > 1.5
    baseline = measure_acceptance(tiny_target, None, prompts, spec("off"), NEW_TOKENS)
    assert baseline["verify_steps"] == baseline["completion_tokens"] - len(prompts)


# ---------------------------------------------------------------- sampling


def test_sampled_path_draws_from_the_target_distribution():
    """Node-level: deterministic children (tree) and a sampled child (chain, min(1, p/q))."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]] + [[0.2] * 5] * 3)
    q = torch.tensor([[0.0] * 5, [0.1, 0.1, 0.5, 0.2, 0.1], [0.0] * 5, [0.0] * 5])
    draws = 8000
    for draft_probs, tokens, parents in [(None, [0, 3, 1, 4], [0, 0, 0, 0]), (q[:2], None, [0, 0])]:
        counts = torch.zeros(5)
        for _ in range(draws):
            if draft_probs is not None:  # a chain drafts its child by sampling from q
                tokens = [0, int(torch.multinomial(q[1], 1, generator=generator))]
            path, bonus = sampled_path(tokens, parents, p[: len(tokens)], draft_probs, generator)
            counts[tokens[path[1]] if len(path) > 1 else bonus] += 1
        assert chi_square_p_value(counts, p[0]) > FALSE_ALARM


@pytest.mark.parametrize("name", ["d3", "tree"])
def test_sampling_preserves_the_sequence_distribution(six_token_case, name):
    """End to end on a 6-token vocab: the first 2 sampled tokens (36 outcomes) follow the
    target's exact joint distribution, computed by brute force (the second token comes from
    a verify step: accepted draft or residual draw)."""
    case, draws = six_token_case, 1000
    target, drafter, prompt = case.target, case.drafter, case.prompt
    temperature, length, exact = case.temperature, case.length, case.exact
    decoder = SpecDecoder(target, drafter, spec(name), DecoderOptions(seed=1))
    counts = torch.zeros(6**length, dtype=torch.float64)
    accepted = rejected = 0
    for _ in range(draws):
        result = decoder.generate(DecodeRequest(prompt, length, temperature=temperature))
        a, b = result.tokens
        counts[a * 6 + b] += 1
        accepted += result.stats.accepted_per_step[0] > 0
        rejected += result.stats.accepted_per_step[0] < decoder.spec.steps
    assert accepted > draws // 10 and rejected > draws // 10  # both branches ran
    assert chi_square_p_value(counts, exact) > FALSE_ALARM


def test_top_p_restricts_to_the_nucleus(tiny_target, fitted, references):
    prompt, _ = references[0]
    decoder = SpecDecoder(tiny_target, fitted, spec("d6"), DecoderOptions(seed=0))
    with torch.no_grad():
        logits = tiny_target.model(torch.tensor([prompt])).logits[0, -1]
    top = int(logits.argmax())
    for _ in range(5):  # top_p tiny: only the most likely token survives
        assert decoder.generate(DecodeRequest(prompt, 1, temperature=1.0, top_p=1e-6)).tokens == [
            top
        ]
