"""Sandbox worker uids are unique on the host: two pools in two processes never share a pair, whatever
their pids, and cleaning up one process's broken worker never touches another process's worker."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tempering.sandbox import LocalSandbox
from tempering.sandbox.uids import kill_uids, lease_worker_ids, processes_of

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="workers get uids of their own only on a root host")

# A second process whose pid *claims* to be ours: a pid-derived uid pair would then equal ours exactly.
OTHER = textwrap.dedent("""
    import json, os, sys
    os.getpid = lambda: {pid}
    from tempering.sandbox import LocalSandbox
    with LocalSandbox(workers=2) as sb:
        ids = [w.ids for w in sb._idle.queue]
        print(json.dumps([[i.server, i.program] for i in ids]), flush=True)
        sys.stdin.readline()  # hold the pool until told
        r = sb.run("print(6 * 7)")
        print(json.dumps(r.stdout), flush=True)
""")


def worker_ids(pool: LocalSandbox) -> set[int]:
    return {u for w in pool._idle.queue for u in (w.ids.server, w.ids.program)}


def test_two_pools_in_two_processes_get_disjoint_uids_and_survive_each_others_cleanup():
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER.format(pid=os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        theirs = {u for pair in json.loads(other.stdout.readline()) for u in pair}
        with LocalSandbox(workers=2) as mine:
            ours = worker_ids(mine)
            assert len(ours) == 4 and len(theirs) == 4
            assert not ours & theirs, "a uid pair is shared between two processes' workers"
            # Break one of our workers and close it: its cleanup SIGKILLs every process of its uids.
            worker = mine._idle.get()
            worker.broken = True
            worker.close()
            assert processes_of(theirs), "the other process's workers must still be running"
        other.stdin.write("\n")
        other.stdin.flush()
        assert json.loads(other.stdout.readline()) == "42\n"
    finally:
        other.kill()
        other.wait()


def test_a_leased_pair_is_not_leased_again_until_released():
    first = lease_worker_ids()
    try:
        others = [lease_worker_ids() for _ in range(20)]
        try:
            assert all((o.server, o.program) != (first.server, first.program) for o in others)
            assert len({o.server for o in others}) == 20
        finally:
            for o in others:
                o.release()
    finally:
        first.release()


def test_a_pair_with_leftover_processes_is_skipped():
    ids = lease_worker_ids()
    leftover = subprocess.Popen(["sleep", "30"], user=ids.server)
    ids.release()  # the lease is free, but a process of the pair still runs
    try:
        again = [lease_worker_ids() for _ in range(50)]
        assert all(a.server != ids.server for a in again)
        for a in again:
            a.release()
    finally:
        kill_uids({ids.server})
        leftover.wait()
