"""Regenerating the assistant turns with the target itself (in-process or through an
OpenAI-compatible server): a resumable per-turn answer log shared by every data output with the
same answers, loop and failure reports."""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3.core.artifacts import config_hash, read_json
from eagle3.core.common import Eagle3Error, log
from eagle3.core.config import Config, DataConfig, RegenConfig, ServeConfig, TargetConfig
from eagle3.core.outputs import answer_sections
from eagle3.core.redact import mask
from eagle3.core.spec import OFF
from eagle3.core.target import Target, load_target, resolve_target_path, target_key
from eagle3.data.conversations import user_turns
from eagle3.data.tokens import end_of_turn, render
from eagle3.serve.launch import EngineProcess, engine_setup, sized_for, start_engine

# starts the engine backend's server from these data and serve settings, in that folder
EngineOpener = Callable[[DataConfig, ServeConfig, Path], EngineProcess]


@dataclass(frozen=True)
class Regeneration:
    """What regenerating the answers reads, resolved once (regeneration): the data settings
    (data.regen), the target, the serving settings (the engine backend's, and the answers' served_by),
    where artifacts live, and how the engine backend's server starts."""

    data: DataConfig
    target: TargetConfig
    serve: ServeConfig
    artifacts: Path
    open_engine: EngineOpener

    @property
    def sections(self) -> dict:
        """answer_sections: what the answers depend on, the key of their shared log."""
        return answer_sections(self.data, self.target, self.serve)

    @property
    def log_path(self) -> Path:
        return regen_log_path(self.sections, self.artifacts)


def regeneration(cfg: Config) -> Regeneration:
    """The data stage's regeneration from the whole config: the one place it reads all of it, since
    the engine backend's server is composed from a whole config (serve.launch; the local engine's
    job file is that config), with the regeneration's data and serve sections in it."""
    artifacts = Path(cfg.paths.artifacts)

    def open_engine(data: DataConfig, serve: ServeConfig, folder: Path) -> EngineProcess:
        engine_cfg = dataclasses.replace(cfg, data=data, serve=serve)
        target_path = resolve_target_path(cfg.target, artifacts)
        return start_engine(engine_setup(engine_cfg), OFF, None, target_path, folder, "regen")

    return Regeneration(cfg.data, cfg.target, cfg.serve, artifacts, open_engine)


def regen_log_path(sections: dict, artifacts: Path | str) -> Path:
    """<artifacts>/regen/<hash>/turns.jsonl, keyed by answer_sections (`sections`): every data output
    with the same answers shares it, so another drafter.draft_vocab_size re-tokenizes instead of
    regenerating (hours on a large target). The data output keeps its own copy in regen/turns.jsonl."""
    return Path(artifacts) / "regen" / config_hash(sections) / "turns.jsonl"


def seed_regen_log(sections: dict, artifacts: Path | str, shared: Path) -> None:
    """A data output written before the shared log existed (this run's own, cut short, or one
    copied from another machine) keeps its answers in its regen/turns.jsonl: the first one under
    `artifacts` with the same answer_sections (`sections`) starts the shared log."""
    wanted = json.loads(json.dumps(sections, default=str))
    for manifest in sorted(Path(artifacts, "data").glob("*/manifest.json")):
        config = read_json(
            manifest, "remove that data output and rerun `python -m eagle3.data`"
        ).get("config", {})
        answers = manifest.parent / "regen" / "turns.jsonl"
        if answers.exists() and {name: config.get(name) for name in wanted} == wanted:
            shared.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(answers, shared)
            return


def answer_key(conv_id: str, prompt: list[dict]) -> str:
    """An answer's key: the conversation up to the turn it answers (system prompt, user turns and the
    target's earlier answers), so an edited prompt gets a new key. The id keeps sampled answers of
    two rows with the same prompt (first-turn copies) apart. The target, engine and sampling
    settings are the log's own key (regen_log_path)."""
    text = json.dumps([conv_id, prompt], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def logged_answers(data: bytes, cut: set[str] | None = None) -> dict[str, str | None]:
    """{answer key: content} from an answer log's complete lines (the first line of a key wins; a
    line without a key, from a log written before keys, answers nothing). The keys of answers the
    length limit cut (finish "length") are added to `cut` when given."""
    answers: dict[str, str | None] = {}
    for line in data[: data.rfind(b"\n") + 1].decode().splitlines():
        record = json.loads(line)
        if "key" in record and record["key"] not in answers:
            answers[record["key"]] = record["content"]
            if cut is not None and record.get("finish") == LENGTH:
                cut.add(record["key"])
    return answers


LENGTH = "length"  # the finish reason of an answer cut by max_new_tokens (OpenAI's finish_reason)


class TurnLog:
    """regen/turns.jsonl: one line per answered turn, {"key", "id", "turn", "content"} (content null
    when the prompt no longer fits max_length; "finish": "length" added when max_new_tokens cut the
    answer), found again by its key (answer_key), never by id and
    turn alone: a rewritten prompt is answered anew. Appended and fsynced as results arrive; a line
    cut by a kill is dropped on reopen, so nothing is duplicated and nothing written is lost."""

    def __init__(self, path: Path):
        self.path = path
        self.answers: dict[str, str | None] = {}
        self.cut: set[str] = set()  # keys of answers cut by the length limit
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            self._load()

    def _load(self) -> None:
        data = self.path.read_bytes()
        complete = data.rfind(b"\n") + 1
        if complete < len(data):
            with open(self.path, "r+b") as file:
                file.truncate(complete)
        self.answers = logged_answers(data, self.cut)

    def key(self, conv_id: str, prompt: list[dict]) -> str:
        return answer_key(conv_id, prompt)

    def find(self, conv_id: str, prompt: list[dict]) -> tuple[bool, str | None]:
        """(whether this prompt was answered, its answer)."""
        key = self.key(conv_id, prompt)
        return key in self.answers, self.answers.get(key)

    def add(self, answered: list[tuple]) -> None:
        """Log (conversation id, turn, prompt, answer[, finish reason]) tuples."""
        records = []
        for conv_id, turn, prompt, content, *finish in answered:
            record = {"key": self.key(conv_id, prompt), "id": conv_id, "turn": turn}
            record["content"] = content
            if finish and finish[0] == LENGTH:
                record["finish"] = LENGTH
            records.append(record)
        self.append(records)

    def usable(self, keep_truncated: bool) -> dict[str, str | None]:
        """The answers as a data output takes them: a cut answer ends its conversation (None)
        unless data.regen.keep_truncated."""
        if keep_truncated or not self.cut:
            return self.answers
        return {k: (None if k in self.cut else v) for k, v in self.answers.items()}

    def append(self, records: list[dict]) -> None:
        with open(self.path, "a") as file:
            file.write("".join(json.dumps(r) + "\n" for r in records))
            file.flush()
            os.fsync(file.fileno())
        for r in records:
            if r["key"] not in self.answers:
                self.answers[r["key"]] = r["content"]
                if r.get("finish") == LENGTH:
                    self.cut.add(r["key"])


def turn_prompt(conversation: dict, answers: dict[int, str | None], turn: int) -> list[dict]:
    """What the target answers at `turn`: the source's system prompt and user turns, its own earlier answers."""
    messages = conversation["messages"]
    prompt = [m for m in messages[:1] if m["role"] == "system"]
    users = [m["content"] for m in messages if m["role"] == "user"]
    for j in range(turn):
        prompt += [
            {"role": "user", "content": users[j]},
            {"role": "assistant", "content": answers[j]},
        ]
    return prompt + [{"role": "user", "content": users[turn]}]


def conversation_answers(conversation: dict, answers_by_key: dict) -> dict:
    """{turn: answer} of the turns logged for this conversation as it reads now, in order up to the
    first turn not logged (or logged as not answered)."""
    answers: dict[int, str | None] = {}
    for turn in range(user_turns(conversation)):
        key = answer_key(conversation["id"], turn_prompt(conversation, answers, turn))
        if key not in answers_by_key:
            break
        answers[turn] = answers_by_key[key]
        if answers[turn] is None:
            break
    return answers


def regenerated(conversation: dict, answers: dict[int, str | None]) -> dict:
    """The conversation with the target's answers, up to its first unanswered turn."""
    turns = 0
    while answers.get(turns) is not None:
        turns += 1
    if not turns:
        return {"id": conversation["id"], "messages": []}
    last = turns - 1
    messages = turn_prompt(conversation, answers, last) + [
        {"role": "assistant", "content": answers[last]}
    ]
    return {"id": conversation["id"], "messages": messages}


def pending_turn(conversation: dict, answers: dict[int, str | None], turn: int) -> bool:
    return (
        turn < user_turns(conversation)
        and turn not in answers
        and all(answers.get(j) is not None for j in range(turn))
    )


def regenerate(
    regen: Regeneration, out_dir: Path, splits: dict[str, list[dict]], tokenizer, counts: dict
):
    """Let the target answer every user turn (into the shared log), then take the answers."""
    shared, own, rcfg = regen.log_path, out_dir / "regen" / "turns.jsonl", regen.data.regen
    with regen_lock(shared.parent):
        turn_log, failed = answer_turns(regen, shared, splits, tokenizer, counts)
    conversations = [c for convs in splits.values() for c in convs]
    keep = rcfg.keep_truncated
    write_own_log(own, turn_log, conversations, keep)
    report_failures(out_dir, failed, rcfg, counts)
    report_cut(conversations, turn_log, rcfg, counts)
    answers = turn_log.usable(keep)
    splits = {
        name: [
            regenerated(c, conversation_answers(c, answers)) for c in convs if c["id"] not in failed
        ]
        for name, convs in splits.items()
    }
    report_loops(splits, rcfg.loop_ngram, counts)
    return splits


def report_cut(conversations: list[dict], turn_log: TurnLog, rcfg: RegenConfig, counts: dict):
    """counts regen_cut_at_length (answers of these conversations that max_new_tokens cut, as far as
    their conversations go) and regen_cut_dropped (those that ended their conversation there)."""
    keep = rcfg.keep_truncated
    usable, cut = turn_log.usable(keep), 0
    for c in conversations:
        answers: dict[int, str | None] = {}
        for turn in range(user_turns(c)):
            key = answer_key(c["id"], turn_prompt(c, answers, turn))
            if key not in usable:
                break
            cut += key in turn_log.cut
            answers[turn] = usable[key]
            if answers[turn] is None:
                break
    counts["regen_cut_at_length"] = cut
    counts["regen_cut_dropped"] = 0 if keep else cut
    if cut:
        log.info(
            "data: %d regenerated answers were cut by data.regen.max_new_tokens=%s; %s",
            cut,
            rcfg.max_new_tokens,
            "kept (data.regen.keep_truncated=true)" if keep else "each ends its conversation there",
        )


def write_own_log(path: Path, turn_log: TurnLog, conversations: list[dict], keep=False) -> None:
    """The data output's copy of the answers it was built from, in conversation and turn order (the
    shared log also holds answers to prompts since rewritten, and other outputs' conversations);
    a cut answer is written with its finish reason (and, dropped, ends its conversation)."""
    usable = turn_log.usable(keep)
    records = []
    for c in conversations:
        answers = conversation_answers(c, usable)
        for turn, content in sorted(answers.items()):
            key = turn_log.key(c["id"], turn_prompt(c, answers, turn))
            record = {"key": key, "id": c["id"], "turn": turn, "content": content}
            if key in turn_log.cut:
                record["content"] = turn_log.answers[key]
                record["finish"] = LENGTH
            records.append(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)


@contextmanager
def regen_lock(folder: Path) -> Iterator[None]:
    """One writer per shared answer log: a second data run with the same answers (another draft vocab in
    a parallel sweep) waits here, then finds every answer logged instead of generating them again.
    An flock is released by the kernel when its holder dies, so a crash leaves no stale lock."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            log.info(
                "data: another data run (%s) is regenerating the answers in %s; waiting for it, then "
                "its answers are reused",
                handle.read().strip() or "pid unknown",
                folder,
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.truncate(0)
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def answer_turns(
    regen: Regeneration, shared: Path, splits: dict[str, list[dict]], tokenizer, counts: dict
):
    """Turn-major, so each batch mixes conversations: -> (the shared TurnLog, {conversation id: error})."""
    rcfg, sections = regen.data.regen, regen.sections
    if not shared.exists():
        seed_regen_log(sections, regen.artifacts, shared)
    turn_log = TurnLog(shared)
    record_answer_sections(sections, shared.parent)
    conversations = [c for convs in splits.values() for c in convs]
    if rcfg.reuse_answers:
        sources = rcfg.reuse_answers
        sources = [sources] if isinstance(sources, str) else list(sources)
        for source in sources:  # every log checked before any is taken
            check_answer_target(regen.target, Path(str(source)))
        counts["regen_turns_reused"] = sum(
            reuse_answers(turn_log, Path(str(source)), conversations) for source in sources
        )
    counts["regen_turns_resumed"] = sum(
        len(conversation_answers(c, turn_log.answers)) for c in conversations
    )
    generator = generator_for(regen)
    failed: dict[str, str] = {}
    try:
        for turn in range(max(map(user_turns, conversations), default=0)):
            items, usable = [], turn_log.usable(rcfg.keep_truncated)
            for c in conversations:
                answers = conversation_answers(c, usable)
                if c["id"] not in failed and pending_turn(c, answers, turn):
                    items.append((c["id"], turn, turn_prompt(c, answers, turn)))
            items = skip_long_prompts(items, tokenizer, regen.data, turn_log)
            if items:
                failed.update(generator.run(items, turn_log, desc=f"regenerate turn {turn + 1}"))
    finally:
        if isinstance(generator, EngineGenerator):
            generator.close()
    return turn_log, failed


BACKENDS = ("local", "openai", "engine")


def generator_for(regen: Regeneration):
    """The configured answer generator (data.regen.backend)."""
    rcfg = regen.data.regen
    check_reasoning(rcfg)
    backend = rcfg.backend
    if backend not in BACKENDS:
        raise Eagle3Error(f"data.regen.backend={backend}: use one of {', '.join(BACKENDS)}")
    if backend == "local":
        return LocalGenerator(load_target(regen.target, regen.artifacts), regen.data)
    return OpenAIGenerator(rcfg) if backend == "openai" else EngineGenerator(regen)


ANSWERS_FILE = "answers.json"  # beside a shared answer log: what its answers depend on (masked)


def record_answer_sections(sections: dict, folder: Path) -> None:
    """Write <folder>/answers.json once: the target and data settings the log's answers come from
    (`sections`: answer_sections, secrets masked), so a later data.regen.reuse_answers can tell
    their target."""
    path = folder / ANSWERS_FILE
    if path.exists():
        return
    sections = mask(json.loads(json.dumps(sections, default=str)))
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(sections, indent=1))
    tmp.replace(path)


def answer_log_target(source: Path) -> dict | None:
    """The target (its key fields) whose answers an answer log holds: from answers.json beside a
    shared log, or the manifest of the data output holding the log (<data>/regen/turns.jsonl); None
    when neither is there (a log from before answers.json, or one copied out alone)."""
    for path, section in (
        (source.parent / ANSWERS_FILE, None),
        (source.parent.parent / "manifest.json", "config"),
    ):
        if path.is_file():
            recorded = read_json(path)
            recorded = recorded.get(section, {}) if section else recorded
            if isinstance(recorded, dict) and isinstance(recorded.get("target"), dict):
                return recorded["target"]
    return None


def describe_target(target: dict, other: dict) -> str:
    """A target's name, with the key fields where it differs from `other` (`tiny-llama (seed 1)`)."""
    differ = [
        k for k in sorted(set(target) | set(other)) if k != "name" and target.get(k) != other.get(k)
    ]
    fields = ", ".join(f"{k} {target.get(k)}" for k in differ)
    return f"{target.get('name')}" + (f" ({fields})" if fields else "")


def check_answer_target(tcfg: TargetConfig, source: Path) -> None:
    """data.regen.reuse_answers takes answers only from logs of this config's target: one written by
    another target is refused naming both; one that does not say which target wrote it is taken
    with a warning naming it."""
    if not source.is_file():
        return  # reuse_answers names it
    theirs = answer_log_target(source)
    ours = json.loads(json.dumps(target_key(tcfg), default=str))
    if theirs is None:
        log.warning(
            "data: %s does not say which target wrote it (no %s beside it, no data manifest above "
            "it): its answers are taken as target %s's",
            source,
            ANSWERS_FILE,
            tcfg.name,
        )
    elif theirs != ours:
        raise Eagle3Error(
            f"data.regen.reuse_answers={source}: its answers were written by target "
            f"{describe_target(theirs, ours)}, this config's target is {describe_target(ours, theirs)}; "
            "another target's answers are not this one's: leave that log out"
        )


def reuse_answers(turn_log: TurnLog, source: Path, conversations: list[dict]) -> int:
    """Copy into this run's log the answers another regeneration logged (data.regen.reuse_answers) for
    these conversations' turns that this log lacks -> how many. An answer is taken only for the same
    conversation so far (its key); it was written by that log's target and settings, which need not
    be these (greedy answers under a sampled regeneration)."""
    if not source.is_file():
        raise Eagle3Error(
            f"data.regen.reuse_answers={source}: no such answer log (a regen/<hash>/turns.jsonl)"
        )
    cut: set[str] = set()
    offered = logged_answers(source.read_bytes(), cut)
    known = {**offered, **turn_log.answers}
    records = []
    for c in conversations:
        answers = conversation_answers(c, known)
        for turn, content in sorted(answers.items()):
            key = turn_log.key(c["id"], turn_prompt(c, answers, turn))
            if key not in turn_log.answers and key in offered:
                records.append({"key": key, "id": c["id"], "turn": turn, "content": content})
                if key in cut:
                    records[-1]["finish"] = LENGTH
    if records:
        turn_log.append(records)
    log.info("data: %d answers reused from %s", len(records), source)
    return len(records)


def loop_start(text: str, ngram: int) -> int | None:
    """Where a word n-gram of `text` comes round for the third time (the answer has fallen into a
    repetition loop): its character offset, or None."""
    words = list(re.finditer(r"\S+", text))
    seen: Counter = Counter()
    for i in range(len(words) - ngram + 1):
        gram = tuple(w.group() for w in words[i : i + ngram])
        seen[gram] += 1
        if seen[gram] == 3:
            return words[i].start()
    return None


def report_loops(splits: dict[str, list[dict]], ngram: int, counts: dict) -> None:
    """counts regen_answers / regen_looping: a greedy small target often repeats itself up to
    max_new_tokens, and those tails are easy tokens that inflate val tau_hat (train.val_head_tokens)."""
    answers = [
        m["content"]
        for convs in splits.values()
        for c in convs
        for m in c["messages"]
        if m["role"] == "assistant"
    ]
    looping = sum(loop_start(a, ngram) is not None for a in answers)
    counts["regen_answers"], counts["regen_looping"] = len(answers), looping
    log.info(
        "data: %d of %d regenerated answers fall into a repetition loop (a word %d-gram 3 times)",
        looping,
        len(answers),
        ngram,
    )


def skip_long_prompts(
    items: list[tuple], tokenizer, dcfg: DataConfig, turn_log: TurnLog
) -> list[tuple]:
    """Prompts that leave no room for an answer within max_length end their conversation there."""
    keep, stop = [], []
    for conv_id, turn, messages in items:
        length = len(
            tokenizer(render(tokenizer, messages, True), add_special_tokens=False)["input_ids"]
        )
        (keep if length < dcfg.max_length else stop).append((conv_id, turn, messages))
    if stop:
        turn_log.add([(conv_id, turn, messages, None) for conv_id, turn, messages in stop])
    return keep


def report_failures(out_dir: Path, failed: dict[str, str], rcfg: RegenConfig, counts: dict) -> None:
    failed_file = out_dir / "regen" / "failed.json"
    counts["regen_failed"] = len(failed)
    if not failed:
        failed_file.unlink(missing_ok=True)
        return
    failed_file.write_text(json.dumps(failed, indent=1))
    if not rcfg.drop_failed:
        raise Eagle3Error(
            f"{len(failed)} conversations failed regeneration at {rcfg.base_url} after "
            f"{rcfg.max_retries} retries (ids and errors in {failed_file}); rerun the same command "
            f"to retry only those, or add data.regen.drop_failed=true to finish without them"
        )


REASONING = (None, "keep", "drop", "off")


def check_reasoning(rcfg: RegenConfig) -> None:
    if rcfg.reasoning not in REASONING:
        raise Eagle3Error(
            f"data.regen.reasoning={rcfg.reasoning}: use null, keep, drop or off (what happens to "
            "the target's thinking text)"
        )


def template_kwargs(rcfg: RegenConfig) -> dict:
    """The chat template's arguments of every regeneration prompt: {data.regen.thinking_switch: False}
    when reasoning=off."""
    return {str(rcfg.thinking_switch): False} if rcfg.reasoning == "off" else {}


def request_extras(rcfg: RegenConfig) -> dict:
    """What a chat request adds for data.regen.reasoning (SGLang and vLLM read
    chat_template_kwargs; the reasoning parser itself is a server flag: regen_engine_config)."""
    kwargs = template_kwargs(rcfg)
    return {"chat_template_kwargs": kwargs} if kwargs else {}


def shape_answer(content: str, thinking: str | None, rcfg: RegenConfig) -> str:
    """The answer kept for training from what the target wrote: `content`, and `thinking` when the
    engine's reasoning parser returned it apart (else any thinking is inline, between think_tags).
    reasoning keep: the thinking stays, as think_tags[0] + thinking + think_tags[1] + answer; drop:
    only the answer after the thinking (none when the thinking never closed); null and off: the
    content as returned."""
    content = content or ""
    opening, closing = rcfg.think_tags
    if rcfg.reasoning == "keep" and thinking:
        return f"{opening}{thinking.strip()}{closing}{content.strip()}"
    if rcfg.reasoning == "drop" and not thinking:
        if closing in content:
            content = content.split(closing, 1)[1]
        elif content.lstrip().startswith(opening):
            content = ""  # the thinking never closed: no answer after it
    return content.strip()


def answer_of(choice: dict, rcfg: RegenConfig) -> tuple[str, str | None]:
    """(answer, finish reason) of an OpenAI chat completion choice. The parser's thinking comes as
    message.reasoning_content (SGLang, vLLM) or message.reasoning (newer vLLM)."""
    message = choice.get("message") or {}
    thinking = message.get("reasoning_content") or message.get("reasoning")
    return shape_answer(message.get("content"), thinking, rcfg), choice.get("finish_reason")


class LocalGenerator:
    """Batched HF generate with left padding, prompts grouped by length."""

    def __init__(self, target: Target, dcfg: DataConfig):
        self.target = target
        self.rcfg = dcfg.regen
        tokenizer = self.target.tokenizer
        self.eot_id = tokenizer.convert_tokens_to_ids(end_of_turn(tokenizer, dcfg))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eot_id
        seed = self.rcfg.seed
        torch.manual_seed(dcfg.seed if seed is None else seed)

    def run(self, items: list[tuple], turn_log: TurnLog, desc: str) -> dict[str, str]:
        tokenizer = self.target.tokenizer
        kwargs = template_kwargs(self.rcfg)
        encoded = [
            tokenizer(render(tokenizer, m, True, **kwargs), add_special_tokens=False)["input_ids"]
            for _, _, m in items
        ]
        order = sorted(range(len(items)), key=lambda i: len(encoded[i]))
        size = self.rcfg.batch_size
        for begin in tqdm(range(0, len(order), size), desc=desc, unit=" batch"):
            batch = order[begin : begin + size]
            answers = self.generate([encoded[i] for i in batch])
            turn_log.add([(*items[i], *answer) for i, answer in zip(batch, answers)])
        return {}

    @torch.no_grad()
    def generate(self, prompts: list[list[int]]) -> list[tuple[str, str | None]]:
        """(answer, finish reason: "length" when no end-of-turn came within max_new_tokens)."""
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        sample = self.rcfg.temperature > 0
        extra = {"temperature": self.rcfg.temperature, "top_p": self.rcfg.top_p} if sample else {}
        out = self.target.model.generate(
            input_ids=ids.to(self.target.device),
            attention_mask=mask.to(self.target.device),
            max_new_tokens=self.rcfg.max_new_tokens,
            do_sample=sample,
            eos_token_id=self.eot_id,
            pad_token_id=self.pad_id,
            **extra,
        )
        return [self.decode(row[width:].tolist()) for row in out]

    def decode(self, tokens: list[int]) -> tuple[str, str | None]:
        finish = "stop" if self.eot_id in tokens else LENGTH
        if self.eot_id in tokens:
            tokens = tokens[: tokens.index(self.eot_id)]
        text = self.target.tokenizer.decode(tokens, skip_special_tokens=True)
        return shape_answer(text, None, self.rcfg), finish


class RequestFailed(Exception):
    pass


class OpenAIGenerator:
    """Any OpenAI-compatible chat endpoint: bounded concurrency, retries with backoff, timeouts.
    The API key comes from the environment variable data.regen.api_key_env and is never logged."""

    def __init__(self, rcfg: RegenConfig):
        import httpx

        self.rcfg = rcfg
        self.url = str(self.rcfg.base_url).rstrip("/")
        try:
            httpx.URL(self.url)
        except httpx.InvalidURL:  # its message may quote part of a password: not repeated
            raise Eagle3Error(
                f"data.regen.base_url={self.url} is not a URL the client can request (a '/' in "
                "its password must be percent-encoded as %2F)"
            ) from None
        key = os.environ.get(str(self.rcfg.api_key_env))
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def run(self, items: list[tuple], turn_log: TurnLog, desc: str) -> dict[str, str]:
        return asyncio.run(self._run(items, turn_log, desc))

    async def _run(self, items, turn_log, desc) -> dict[str, str]:
        import httpx

        failures: dict[str, str] = {}
        limit = asyncio.Semaphore(self.rcfg.concurrency)
        bar = tqdm(total=len(items), desc=desc, unit=" req")
        async with httpx.AsyncClient(timeout=self.rcfg.timeout_s, headers=self.headers) as client:
            model = self.rcfg.model or await self.first_model(client)

            async def answer(conv_id, turn, messages):
                async with limit:
                    try:
                        content, finish = await self.complete(client, model, messages)
                        turn_log.add([(conv_id, turn, messages, content, finish)])
                    except RequestFailed as err:
                        failures[conv_id] = str(err)
                bar.update(1)

            await asyncio.gather(*(answer(*item) for item in items))
        bar.close()
        return failures

    async def first_model(self, client) -> str:
        import httpx

        try:
            response = await client.get(f"{self.url}/models")
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
            raise Eagle3Error(
                f"cannot list models at {self.url}/models ({type(err).__name__}); is the server up? "
                "Or set data.regen.model"
            ) from err

    async def complete(self, client, model: str, messages: list[dict]) -> tuple[str, str | None]:
        """(the answer as data.regen.reasoning shapes it, the finish reason)."""
        import httpx

        body = {
            "model": model,
            "messages": messages,
            "max_tokens": self.rcfg.max_new_tokens,
            "temperature": self.rcfg.temperature,
            "top_p": self.rcfg.top_p,
            **request_extras(self.rcfg),
        }
        error = "no attempt"
        for attempt in range(self.rcfg.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.rcfg.backoff_s * 2 ** (attempt - 1))
            try:
                response = await client.post(f"{self.url}/chat/completions", json=body)
            except httpx.HTTPError as err:
                error = type(err).__name__
                continue
            if response.status_code == 200:
                return answer_of(response.json()["choices"][0], self.rcfg)
            error = f"HTTP {response.status_code}: {response.text[:200]}"
            if response.status_code < 500 and response.status_code != 429:
                break  # a request the server rejects will not succeed on retry
        raise RequestFailed(error)


def regen_engine_config(scfg: ServeConfig, rcfg: RegenConfig) -> ServeConfig:
    """The serving settings the regeneration engine is started with: `scfg` sized for
    data.regen.concurrency requests at once (serve.launch.sized_for). With
    data.regen.reasoning_parser the engine gets --reasoning-parser (it returns the thinking apart)."""
    scfg = sized_for(scfg, rcfg.concurrency)
    parser = rcfg.reasoning_parser
    if parser and scfg.engine in ("sglang", "vllm"):  # both name the flag alike
        scfg = dataclasses.replace(
            scfg, extra_args=[*scfg.extra_args, "--reasoning-parser", str(parser)]
        )
    return scfg


class EngineGenerator:
    """data.regen.backend=engine: the configured engine (serve=vllm, serve=sglang, serve=local)
    started with spec=off on the first batch of turns (its batch settings sized for
    data.regen.concurrency: regen_engine_config), answering through its OpenAI chat endpoint
    like the openai backend (same concurrency, retries and turn log), stopped by close() and on
    error, Ctrl-C or a kill of this process (the engine's own process group and watchdog)."""

    def __init__(self, regen: Regeneration):
        self.regen = regen
        self.serve = regen_engine_config(regen.serve, regen.data.regen)
        self.folder = regen.log_path.parent / "engine"
        self.engine = None
        self.client = OpenAIGenerator(regen.data.regen)

    def run(self, items: list[tuple], turn_log: TurnLog, desc: str) -> dict[str, str]:
        if self.engine is None:
            self.engine = self.regen.open_engine(self.regen.data, self.serve, self.folder)
            self.client.url = f"{self.engine.base_url}/v1"
            self.client.headers = self.engine.launch.headers
        return self.client.run(items, turn_log, desc)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop(self.serve.stop_timeout_s)
            self.engine = None


def sampling_params(dcfg: DataConfig) -> dict | None:
    if not dcfg.regenerate:
        return None
    r = dcfg.regen
    return {
        "backend": r.backend,
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "top_p": r.top_p,
        **({"base_url": r.base_url, "model": r.model} if r.backend == "openai" else {}),
        **({"reasoning": r.reasoning} if r.reasoning else {}),
        **({"reasoning_parser": r.reasoning_parser} if r.reasoning_parser else {}),
    }
