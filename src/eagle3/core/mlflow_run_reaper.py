"""`python mlflow_run_reaper.py PARENT PARENT_START POLL_S HOST URI EXPERIMENT_ID`: marks the MLflow runs a
killed process left RUNNING as KILLED.

Started (setsid: apart from its parent's process group) by eagle3.core.tracking when a process
opens its first run in a store: while the parent lives it only polls its parent pid (standard
library only, ~10 MB). Once the parent is gone without stopping it (SIGKILL, the OOM killer), it
opens the store and ends every run still RUNNING that holds the parent's process identity (host,
pid, pid start time: the tags of eagle3.core.lifecycle.process_identity), then exits. A parent that
exits normally kills it first.
"""

from __future__ import annotations

import os
import signal
import sys
import time

REASON = "its process was killed before it could close the run"


def wait_for_parent_death(parent: int, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)


def end_runs_of(identity: dict[str, str], uri: str, experiment_id: str) -> list[str]:
    """Mark RUNNING runs tagged with `identity` KILLED; returns their ids."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    query = f"attributes.status = 'RUNNING' and tags.\"eagle3.pid\" = '{identity['eagle3.pid']}'"
    ended = []
    for run in client.search_runs([experiment_id], query):
        tags = run.data.tags
        if all(tags.get(key) == value for key, value in identity.items()):
            client.set_tag(run.info.run_id, "killed", REASON)
            client.set_terminated(run.info.run_id, "KILLED")
            ended.append(run.info.run_id)
    return ended


def main(argv: list[str]) -> None:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # only the parent's death (or its SIGKILL) ends it
    parent, parent_start, poll_s, host, uri, experiment_id = argv
    wait_for_parent_death(int(parent), float(poll_s))
    identity = {"eagle3.host": host, "eagle3.pid": parent, "eagle3.pid_start": parent_start}
    end_runs_of(identity, uri, experiment_id)


if __name__ == "__main__":
    main(sys.argv[1:])
