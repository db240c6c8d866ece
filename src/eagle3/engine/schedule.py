"""The speculative shape per live batch size: the load sweep's schedule file (eagle3.bench.concurrency writes it,
beside the drafter's export and in the sweep folder) read back for the batched engine.

A file lists, per (engine, suite, max tokens, drafter), the shape to run at each measured batch
size. The engine takes the embedded engine's ("local") entries and runs, at a live batch of B rows,
the entry of the largest measured batch size <= B (the smallest one below it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagle3.core.common import Eagle3Error, log
from eagle3.core.spec import OFF, Spec, max_tree_nodes

SCHEDULE_FILE = "schedule.json"
ENGINE = "local"  # the schedule entries measured on this engine


@dataclass(frozen=True)
class Schedule:
    """(batch size, shape) pairs, ascending batch size; a one-entry schedule is a fixed shape."""

    entries: tuple[tuple[int, Spec], ...]
    source: str = ""

    @staticmethod
    def fixed(spec: Spec) -> Schedule:
        return Schedule(((1, spec),), "fixed")

    def shape_for(self, batch: int) -> Spec:
        chosen = self.entries[0][1]
        for size, spec in self.entries:
            if size <= batch:
                chosen = spec
        return chosen

    @property
    def shapes(self) -> list[Spec]:
        """Every shape the schedule names, each once, in batch order."""
        return list(dict.fromkeys(spec for _, spec in self.entries))

    def describe(self) -> str:
        return ", ".join(f"{size}+: {spec.label}" for size, spec in self.entries)


def resolve_schedule_path(setting, drafter_source: str | None) -> Path | None:
    """engine.schedule -> the file to read: `off` none, `auto` the drafter's (beside its export
    folder, where eagle3.bench.concurrency writes it) when it exists, else the path given."""
    text = str(setting).strip() if setting is not None else "off"
    if text in ("off", "", "None", "False"):
        return None
    if text == "auto":
        if not drafter_source or not Path(drafter_source).exists():
            return None
        beside = Path(drafter_source).parent / SCHEDULE_FILE
        return beside if beside.is_file() else None
    path = Path(text)
    if not path.is_file():
        raise Eagle3Error(
            f"engine.schedule={text}: no such file; give a load sweep's {SCHEDULE_FILE}, "
            "auto (the one beside the drafter) or off"
        )
    return path


def read_schedule(path: Path) -> Schedule:
    """The local engine's entries of a schedule file (the first group holding them)."""
    try:
        groups = json.loads(path.read_text())
        local = [g for g in groups if g.get("engine") == ENGINE and g.get("entries")]
    except (json.JSONDecodeError, AttributeError, TypeError) as err:
        raise Eagle3Error(
            f"{path}: not a load sweep schedule ({err}); rerun the load sweep or set "
            "engine.schedule=off"
        ) from err
    if not local:
        raise Eagle3Error(
            f"{path}: no entries measured on serve={ENGINE}; run the load sweep with serve=local "
            "or set engine.schedule=off"
        )
    group = local[0]
    if len(local) > 1:
        log.info(
            "%s holds %d local groups; running the one of suite %s, max tokens %s",
            path,
            len(local),
            group.get("suite"),
            group.get("max_new_tokens"),
        )
    entries = []
    for index, entry in enumerate(group["entries"]):
        entries.append((int(entry["batch_size"]), shape_of(entry["spec"], path, index)))
    return Schedule(tuple(sorted(entries, key=lambda e: e[0])), str(path))


def shape_of(fields: dict, path: Path, index: int) -> Spec:
    """A schedule entry's `spec` ({label, depth, steps, topk}) as a Spec."""
    if fields.get("label") == "off":
        return OFF
    depth, steps, topk = int(fields["depth"]), int(fields["steps"]), int(fields["topk"])
    chain_ok = topk == 1 and steps == depth - 1
    tree_ok = topk > 1 and steps >= 1 and depth - 1 <= max_tree_nodes(steps, topk)
    if depth < 2 or not (chain_ok or tree_ok):
        raise Eagle3Error(
            f"{path}: entry {index} has an impossible shape {fields}; rerun the load sweep"
        )
    return Spec(enabled=True, depth=depth, steps=steps, topk=topk)
