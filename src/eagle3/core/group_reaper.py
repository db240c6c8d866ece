"""`python -m eagle3.core.group_reaper PARENT PGID GRACE_S POLL_S`: a watchdog that outlives its parent.

Started (setsid: apart from its parent's process group) by a process that launched a child
process group: as soon as that parent is gone (SIGKILL included: the reaper is re-parented, so its
parent pid changes) it sends SIGTERM to the group, SIGKILL after GRACE_S, and exits. It exits by itself once the group is gone.
Imports nothing but the standard library: it starts in milliseconds and holds ~10 MB.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def end_group(pgid: int, grace_s: float, poll_s: float) -> None:
    """SIGTERM the group, SIGKILL whatever is left after grace_s."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and group_alive(pgid):
            time.sleep(poll_s)
        if not group_alive(pgid):
            return


def watch(parent: int, pgid: int, grace_s: float, poll_s: float) -> None:
    while group_alive(pgid):
        if os.getppid() != parent:
            end_group(pgid, grace_s, poll_s)
            return
        time.sleep(poll_s)


def main(argv: list[str]) -> None:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # only the parent's death or the group's end stop it
    parent, pgid = int(argv[0]), int(argv[1])
    watch(parent, pgid, float(argv[2]), float(argv[3]))


if __name__ == "__main__":
    main(sys.argv[1:])
