"""Conversations to token ids and a loss mask over the assistant turns, through the target's chat
template."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eagle3.core.common import Eagle3Error
from eagle3.core.config import DataConfig, TargetConfig
from eagle3.core.target import (
    download_hint,
    remote_code_error,
    resolve_target_path,
    target_tokenizer,
    trust_remote_code,
)


def render(tokenizer, messages: list[dict], generation_prompt: bool = False, **kwargs) -> str:
    """The chat template's text; kwargs go to the template (data.regen.thinking_switch)."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
    )


def end_of_turn(tokenizer, dcfg: DataConfig) -> str:
    return str(dcfg.end_of_turn) if dcfg.end_of_turn else tokenizer.eos_token


def assistant_spans(tokenizer, messages: list[dict], eot: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of each assistant content (+ end-of-turn).

    A span starts where the template's generation prompt for that turn ends, found by
    rendering the conversation up to the turn; no template-specific offsets."""
    text, spans = render(tokenizer, messages), []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = render(tokenizer, messages[:i], generation_prompt=True)
        if not text.startswith(prefix):
            raise Eagle3Error(
                "the chat template does not render conversations prefix-consistently; "
                "assistant spans cannot be located"
            )
        start = text.find(message["content"].strip(), len(prefix))
        if start < 0:
            raise Eagle3Error(
                "the chat template alters assistant contents; assistant spans cannot be located"
            )
        end = start + len(message["content"].strip())
        if eot and text.startswith(eot, end):
            end += len(eot)
        spans.append((len(prefix), end))
    return text, spans


def tokenize_conversations(
    tokenizer, conversations: list[dict], dcfg: DataConfig, counts: Counter
) -> dict:
    """Columns id / input_ids / loss_mask (1 on assistant contents and their end-of-turn token)."""
    eot = end_of_turn(tokenizer, dcfg)
    columns: dict[str, list] = {"id": [], "input_ids": [], "loss_mask": []}
    step = dcfg.tokenize_batch
    for begin in tqdm(
        range(0, len(conversations), step), desc="tokenize", unit=" batch", mininterval=2
    ):
        batch = [
            c
            for c in conversations[begin : begin + step]
            if any(m["role"] == "assistant" for m in c["messages"])
        ]
        counts["dropped_no_assistant_tokens"] += min(step, len(conversations) - begin) - len(batch)
        if not batch:
            continue
        rendered = [assistant_spans(tokenizer, c["messages"], eot) for c in batch]
        encoded = encode_with_offsets(tokenizer, rendered)
        for conversation, (_, spans), (ids, offsets) in zip(batch, rendered, encoded):
            mask = loss_mask_of(offsets, spans)
            if len(ids) > dcfg.max_length:
                counts["truncated" if dcfg.truncation == "truncate" else "dropped_too_long"] += 1
                if dcfg.truncation != "truncate":
                    continue
                ids, mask = ids[: dcfg.max_length], mask[: dcfg.max_length]
            if not any(mask):
                counts["dropped_no_assistant_tokens"] += 1
                continue
            columns["id"].append(conversation["id"])
            columns["input_ids"].append(ids)
            columns["loss_mask"].append(mask)
    return columns


def encode_with_offsets(tokenizer, rendered: list[tuple[str, list]]) -> list[tuple[list, list]]:
    """(token ids, character offsets of each token) per rendered conversation. A Python tokenizer
    (Kimi's tiktoken class) has no offsets: each text is encoded piece by piece between the assistant
    spans' edges, every token taking its piece's bounds, and must equal the whole text's encoding
    (the templates put a special token at each edge, where no token crosses)."""
    texts = [text for text, _ in rendered]
    if getattr(tokenizer, "is_fast", True):
        out = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return list(zip(out["input_ids"], out["offset_mapping"]))
    wholes = tokenizer(texts, add_special_tokens=False)["input_ids"]
    encoded = []
    for (text, spans), whole in zip(rendered, wholes):
        edges = sorted({0, len(text), *(edge for span in spans for edge in span)})
        ids, offsets = [], []
        for begin, end in zip(edges, edges[1:]):
            piece = tokenizer(text[begin:end], add_special_tokens=False)["input_ids"]
            ids += piece
            offsets += [(begin, end)] * len(piece)
        if ids != whole:
            raise Eagle3Error(
                f"the target's tokenizer ({type(tokenizer).__name__}, which gives no character "
                "offsets) joins characters across an assistant turn's edge into one token: the loss "
                "mask cannot be placed; set data.end_of_turn to the token that closes a turn"
            )
        encoded.append((ids, offsets))
    return encoded


def loss_mask_of(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 on every token holding a character of a span: a token that straddles the edge (" The"
    after "assistant:") is still one the target emits when it answers."""
    bounds = np.array(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(offsets), dtype=np.int8)
    for begin, end in spans:
        mask[(bounds[:, 0] < end) & (bounds[:, 1] > begin)] = 1
    return mask.tolist()


def load_tokenizer(tcfg: TargetConfig, artifacts: str | Path):
    """The target's tokenizer and vocabulary size (no weights loaded; a downloaded target is looked
    for under `artifacts`)."""
    from transformers import AutoConfig

    path = resolve_target_path(tcfg, Path(artifacts))
    trust = trust_remote_code(tcfg)
    try:
        tokenizer = target_tokenizer(path, tcfg)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
        # a multimodal wrapper (Kimi-K2.5) keeps the vocabulary in its text config
        return tokenizer, config.get_text_config().vocab_size
    except OSError as err:
        if isinstance(path, str):  # a hub id this machine cannot reach
            hint = download_hint(tcfg, Path(artifacts))
            raise Eagle3Error(f"cannot load the tokenizer of target {path}: {hint}") from err
        raise Eagle3Error(f"cannot load the tokenizer of target {path!s}: {err}") from err
    except ValueError as err:
        raise remote_code_error(path, err) from err
