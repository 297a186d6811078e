"""python -m tpcore.cleanup [--dry-run] [--job JOB_ID]

Removes this user's tpcore shared-memory names in /dev/shm that no live
process uses: what a job can leave when all its processes are killed at once
(SIGKILL of the whole process group, the OOM killer) at a moment when a name
exists.  Segments of running jobs are locked by their processes and are kept;
other users' names are never touched.  Every tpcore start does the same for
its user, and python -m tpcore.launch runs it when a job ends however it ends,
so this command is rarely needed.
"""
from __future__ import annotations

import argparse
import sys

from tpcore.utils.cleanup import remove_shm, shm_segments


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tpcore.cleanup", description=__doc__.split("\n\n")[1])
    ap.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    ap.add_argument("--job", default="", help="only this job id's names")
    ns = ap.parse_args(argv)
    removed = remove_shm(ns.job, dry_run=ns.dry_run)
    verb = "would remove" if ns.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    kept = [p for p in shm_segments(ns.job) if p not in removed]
    print(f"tpcore.cleanup: {verb} {len(removed)} segment(s); {len(kept)} in use by running jobs kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
