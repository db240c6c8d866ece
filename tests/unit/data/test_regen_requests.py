"""What regeneration asks an engine for and what it keeps: the thinking text of a reasoning target
(data.regen.reasoning, the engine's --reasoning-parser), answers cut by max_new_tokens (counted,
dropped unless data.regen.keep_truncated), and engine batch settings sized for the requests sent."""

from __future__ import annotations

import dataclasses
import json

import pytest
from support import SGLANG_PYTHON

from eagle3.core.spec import OFF
from eagle3.data import regen
from eagle3.serve.launch import compose_launch, engine_setup

THINKING = {"reasoning_content": "2 and 2 make 4.", "content": "4"}


def rcfg(make_cfg, *overrides):
    return make_cfg(*(f"data.regen.{o}" for o in overrides)).data.regen


def test_answers_keep_drop_or_pass_the_thinking(make_cfg):
    choice = {"message": THINKING, "finish_reason": "stop"}
    assert regen.answer_of(choice, rcfg(make_cfg, "reasoning=keep")) == (
        "<think>2 and 2 make 4.</think>4",
        "stop",
    )
    for mode in ("drop", "off", "null"):
        assert regen.answer_of(choice, rcfg(make_cfg, f"reasoning={mode}")) == ("4", "stop")
    # no reasoning parser: the thinking comes inline, found by data.regen.think_tags
    inline = {"message": {"content": "<think>2 and 2.</think>\n4"}, "finish_reason": "stop"}
    assert regen.answer_of(inline, rcfg(make_cfg, "reasoning=drop"))[0] == "4"
    assert (
        regen.answer_of(inline, rcfg(make_cfg, "reasoning=keep"))[0] == "<think>2 and 2.</think>\n4"
    )
    tags = rcfg(make_cfg, "reasoning=drop", 'think_tags=["◁think▷","◁/think▷"]')
    assert regen.shape_answer("◁think▷x◁/think▷ y", None, tags) == "y"
    # thinking cut by the length limit before it closed: no answer after it
    unclosed = {"message": {"content": "<think>2 and"}, "finish_reason": "length"}
    assert regen.answer_of(unclosed, rcfg(make_cfg, "reasoning=drop")) == ("", "length")
    # newer vLLM names the parser's field `reasoning`
    vllm = {"message": {"reasoning": "r", "content": " a "}, "finish_reason": "length"}
    assert regen.answer_of(vllm, rcfg(make_cfg, "reasoning=keep")) == (
        "<think>r</think>a",
        "length",
    )
    with pytest.raises(regen.Eagle3Error, match="data.regen.reasoning=maybe: use null, keep"):
        regen.generator_for(regen.regeneration(make_cfg("data.regen.reasoning=maybe")))


def test_thinking_is_switched_off_through_the_chat_template(make_cfg):
    assert regen.request_extras(rcfg(make_cfg, "reasoning=off")) == {
        "chat_template_kwargs": {"thinking": False}
    }
    qwen = rcfg(make_cfg, "reasoning=off", "thinking_switch=enable_thinking")
    assert regen.request_extras(qwen) == {"chat_template_kwargs": {"enable_thinking": False}}
    for mode in ("keep", "drop", "null"):
        assert regen.request_extras(rcfg(make_cfg, f"reasoning={mode}")) == {}


def conversation(conv_id: str, *users: str) -> dict:
    messages = []
    for text in users:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": "old"}]
    return {"id": conv_id, "messages": messages}


def test_answers_cut_by_the_length_limit_end_their_conversation_unless_kept(
    make_cfg, own_artifacts
):
    """Every turn already logged (the openai backend sends nothing): a's first answer and b's second
    were cut by max_new_tokens."""
    a, b = conversation("a", "Hi.", "More."), conversation("b", "Why?", "And?", "So?")
    answers = {
        ("a", 0): "Hel",
        ("a", 1): "Sure.",
        ("b", 0): "Because.",
        ("b", 1): "An",
        ("b", 2): "Ok.",
    }
    cut = {("a", 0), ("b", 1)}
    base = ["data.regenerate=true", "data.regen.backend=openai", f"paths.artifacts={own_artifacts}"]
    log = regen.TurnLog(regen.regeneration(make_cfg(*base)).log_path)
    for c in (a, b):
        said: dict[int, str] = {}
        for turn in range(len(c["messages"]) // 2):
            said[turn] = answers[(c["id"], turn)]
            finish = "length" if (c["id"], turn) in cut else "stop"
            log.add([(c["id"], turn, regen.turn_prompt(c, said, turn), said[turn], finish)])
    results = {}
    for keep in (False, True):
        cfg = make_cfg(*base, f"data.regen.keep_truncated={str(keep).lower()}")
        out, counts = own_artifacts / f"out-{keep}", {}
        splits = regen.regenerate(regen.regeneration(cfg), out, {"train": [a, b]}, None, counts)
        results[keep] = {
            c["id"]: [m["content"] for m in c["messages"] if m["role"] == "assistant"]
            for c in splits["train"]
        }
        assert (counts["regen_cut_at_length"], counts["regen_cut_dropped"]) == (
            (2, 0) if keep else (2, 2)
        )
        own = [
            json.loads(line) for line in (out / "regen" / "turns.jsonl").read_text().splitlines()
        ]
        assert [(r["id"], r["turn"]) for r in own if r.get("finish") == "length"] == sorted(cut)
    assert results[False] == {"a": [], "b": ["Because."]}  # nothing of a; b up to its cut turn
    assert results[True] == {"a": ["Hel", "Sure."], "b": ["Because.", "An", "Ok."]}
    # a second log opened on the same file knows which answers were cut
    assert regen.TurnLog(log.path).cut == log.cut and len(log.cut) == 2


def test_the_local_backend_marks_answers_without_an_end_of_turn_as_cut(make_cfg, tiny_target):
    cfg = make_cfg("target=tiny-llama", "data.regenerate=true")
    generator = regen.LocalGenerator(regen.load_target(cfg.target, cfg.paths.artifacts), cfg.data)
    words = generator.target.tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    assert generator.decode([*words, generator.eot_id, *words]) == ("Hello there", "stop")
    assert generator.decode(words) == ("Hello there", "length")


def regen_engine(cfg):
    """The config the regeneration engine starts from: serve sized by regen_engine_config."""
    return dataclasses.replace(cfg, serve=regen.regen_engine_config(cfg.serve, cfg.data.regen))


def test_regeneration_engines_batch_the_requests_sent_and_parse_reasoning(make_cfg):
    """SGLang's CUDA graphs and vLLM's scheduler cover data.regen.concurrency; the reasoning parser
    flag reaches both; SGLang's own parser accepts the command."""
    assert SGLANG_PYTHON.exists(), "run `make sglang` (tools/setup_sglang.sh) to build .venv-sglang"
    regen_args = ["data.regenerate=true", "data.regen.backend=engine", "target=tiny-llama"]
    sglang = make_cfg(
        *regen_args,
        "serve=sglang",
        f"serve.python={SGLANG_PYTHON}",
        "data.regen.concurrency=64",
        "data.regen.reasoning_parser=kimi_k2",
    )
    argv = compose_launch(engine_setup(regen_engine(sglang)), OFF, None, "/m", 30000).argv
    flag = "--cuda-graph-max-bs-decode"  # SGLang >= 0.5.20 (.venv-sglang)
    assert argv[argv.index(flag) + 1] == "64"
    assert argv[argv.index("--reasoning-parser") + 1] == "kimi_k2"
    assert sglang.serve.cuda_graph_max_bs == 8  # serve's own setting, for the bench, unchanged
    bundle = make_cfg(*regen_args, "serve=sglang-bundle", "data.regen.concurrency=256")
    argv = compose_launch(engine_setup(regen_engine(bundle)), OFF, None, "/m", 30000).argv
    assert argv[argv.index("--cuda-graph-max-bs") + 1] == "256"  # SGLang 0.5.14's name
    assert "--reasoning-parser" not in argv
    few = make_cfg(*regen_args, "serve=sglang-bundle", "data.regen.concurrency=4")
    argv = compose_launch(engine_setup(regen_engine(few)), OFF, None, "/m", 30000).argv
    assert argv[argv.index("--cuda-graph-max-bs") + 1] == "8"  # never lowered
    vllm = make_cfg(
        *regen_args,
        "serve=vllm",
        "data.regen.concurrency=32",
        "data.regen.reasoning_parser=kimi_k2",
    )
    argv = compose_launch(engine_setup(regen_engine(vllm)), OFF, None, "/m", 30000).argv
    assert argv[argv.index("--max-num-seqs") + 1] == "32"
    assert argv[argv.index("--reasoning-parser") + 1] == "kimi_k2"
