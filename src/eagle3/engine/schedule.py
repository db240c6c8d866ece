"""The speculative shape per live batch size: the load sweep's schedule file (eagle3.bench.concurrency writes it,
beside the drafter's export and in the sweep folder) read back for the batched engine.

A file lists, per (engine, suite, max tokens, drafter), the shape to run at each measured batch
size and the hardware and engine version it was measured on. The engine takes the embedded
engine's ("local") entries and runs, at a live batch of B rows, the entry of the largest measured
batch size <= B (the smallest one below it).

A schedule runs only when named: `engine.schedule=<file>`, or `spec=auto` (or `engine.schedule=auto`)
for the file beside the drafter; never because a file happens to lie there (a spec given on the
command line is the spec that runs). It runs only on the hardware and engine version it was
measured on; anywhere else it is refused in one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagle3.core.common import Eagle3Error, hardware, local_engine_version, log
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


OFF_SETTINGS = ("off", "", "None", "False", "null")


def resolve_schedule_path(setting, drafter_source: str | None, auto: bool = False) -> Path | None:
    """engine.schedule -> the file to read: `off` none (unless `auto`: spec=auto asked for the
    drafter's), `auto` the one beside the drafter's export folder (where eagle3.bench.concurrency
    writes it), else the path given. A schedule asked for and not found is refused."""
    text = str(setting).strip() if setting is not None else "off"
    if text in OFF_SETTINGS and not auto:
        return None
    if text in OFF_SETTINGS or text == "auto":
        asked = "spec=auto" if auto and text != "auto" else "engine.schedule=auto"
        beside = Path(drafter_source).parent / SCHEDULE_FILE if drafter_source else None
        if beside is None or not Path(drafter_source).exists() or not beside.is_file():
            raise Eagle3Error(
                f"{asked}: no {SCHEDULE_FILE} beside the drafter ({drafter_source or 'none'}); "
                "run a load sweep on this machine (python -m eagle3.bench -m spec=off,... "
                "bench.batch_size=1,4,16), give engine.schedule=<file> or a spec (spec.depth=...)"
            )
        return beside
    path = Path(text)
    if not path.is_file():
        raise Eagle3Error(
            f"engine.schedule={text}: no such file; give a load sweep's {SCHEDULE_FILE}, "
            "auto (the one beside the drafter) or off"
        )
    return path


def schedule_for(setting, auto: bool, spec: Spec, drafter_source: str | None) -> Schedule | None:
    """The schedule the embedded engine runs for engine.schedule=`setting` (`auto`: spec=auto
    asked for the drafter's), None: `spec` at every step; checked against this machine's
    hardware and engine version. spec=off drafts nothing and runs none."""
    source = drafter_source if spec.enabled else None
    if not spec.enabled and str(setting) == "auto":
        return None
    path = resolve_schedule_path(setting, source, auto)
    if path is None:
        return None
    return read_schedule(path, hardware(), local_engine_version())


def shapes_line(schedule: Schedule | None, spec: Spec) -> str:
    """Which shape runs at which batch size, in words (the server says it at start)."""
    if schedule is None:
        return f"shape per batch size: {spec.label} at every batch size"
    return f"shape per batch size (schedule {schedule.source}): {schedule.describe()}"


def read_schedule(
    path: Path, machine: str | None = None, engine_version: str | None = None
) -> Schedule:
    """The local engine's entries of a schedule file (the first group holding them), refused when
    `machine` or `engine_version` (when given) differ from what the group was measured on."""
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
    for key, here in (("hardware", machine), ("engine_version", engine_version)):
        if here is not None and group.get(key) != here:
            measured = group.get(key) or f"a {key.replace('_', ' ')} it does not record"
            raise Eagle3Error(
                f"{path}: measured on {measured}, this machine runs {here}: a schedule runs only "
                "where it was measured; rerun the load sweep here or serve one shape (spec.*)"
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
