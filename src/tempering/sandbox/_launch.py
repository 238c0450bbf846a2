"""Worker launcher: enters a user namespace with two uids, mounts the scratch tmpfs, then execs the worker.

Run by any python3 as `python3 -c SOURCE CONFIG_JSON` (it imports nothing from tempering), as root on the
host, only where `isolation.py` found that this works (`Isolation.uid_split`). Steps:

1. unshare a user and a mount namespace; write b"U" on fd 1 and wait for b"G" on fd 0. In between the
   host writes our uid/gid maps: uid 0 here is the worker's *server* uid on the host, uid 1 its
   *program* uid (`isolation.map_ids`). Writing a two-uid map needs CAP_SETUID on the host, which is why
   the host does it and why this exists at all (bubblewrap maps one uid only);
2. become uid/gid 0 of the namespace (the server uid on the host): the capabilities this gives hold only
   inside the namespace, i.e. over its two uids and what it owns;
3. make every mount private; bind the import paths read-only at their views (a small tmpfs on
   `imports_root` holds the mount points) while the host's /tmp is still visible - an import path may lie
   under it - then mount the scratch tmpfs with both a size and an inode cap (bubblewrap's own `--tmpfs`
   has no inode option); cap nested user namespaces at zero, so a program cannot get a tmpfs of its own
   outside these caps;
4. for the process backend, keep only the server's capabilities in the bounding set (so the exec'd
   worker gets exactly those) and die with the parent; then set no_new_privs and exec `argv`.
"""

import ctypes
import json
import os
import signal
import sys

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    0x1,
    0x2,
    0x4,
    0x20,
    0x1000,
    0x4000,
    1 << 18,
)
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
CAP_LAST = 63  # PR_CAPBSET_DROP of a capability the kernel does not know fails with EINVAL: ignored


def fail(what):
    sys.stderr.write(f"tempering sandbox launcher: {what}\n")
    os._exit(111)


def check(result, what):
    if result != 0:
        fail(f"{what}: {os.strerror(ctypes.get_errno())}")


def bind_imports(libc, root, imports):
    """Each import path [source, view] bound read-only at its view, under a tmpfs on `root`."""
    if not imports:
        return
    check(
        libc.mount(b"tmpfs", root.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=64k,mode=0755"),
        f"cannot mount a tmpfs on {root}",
    )
    for source, view in imports:
        os.mkdir(view, 0o755)
        check(
            libc.mount(source.encode(), view.encode(), None, MS_BIND | MS_REC, None), f"cannot bind {source}"
        )
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        if libc.mount(None, view.encode(), None, flags | MS_NOSUID | MS_NODEV, None) != 0:
            # A mount's locked flags (from the host) must be kept on a remount: take the source's own.
            kept = (
                os.statvfs(source).f_flag & 0xC0F
            )  # ST_NOSUID/NODEV/NOEXEC/NOATIME/NODIRATIME = the MS_ bits
            check(libc.mount(None, view.encode(), None, flags | kept, None), f"cannot make {view} read-only")


def main():
    config = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "cannot create a user namespace")
    os.write(1, b"U")
    if os.read(0, 1) != b"G":
        fail("the host did not map the namespace's uids")
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    if os.getresuid() != (0, 0, 0):
        fail("could not become the namespace's server uid")
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "cannot make mounts private")
    bind_imports(libc, config.get("imports_root"), config.get("imports") or [])
    options = f"size={int(config['scratch_mb'])}m,nr_inodes={int(config['scratch_inodes'])},mode=1777"
    check(
        libc.mount(b"tmpfs", config["scratch"].encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode()),
        f"cannot mount the scratch tmpfs on {config['scratch']}",
    )
    try:
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")
    except OSError:
        pass  # reported by the worker (it reads the value back) and by `tempering sandbox doctor`
    keep = config.get("bounding_caps")
    if keep is not None:
        for cap in range(CAP_LAST + 1):
            if (
                cap not in keep
                and libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0
                and ctypes.get_errno() != 22
            ):
                fail(f"cannot drop capability {cap} from the bounding set")
    if config.get("die_with_parent"):
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "cannot set the parent-death signal")
        if os.getppid() == 1:
            os._exit(112)  # the parent is already gone
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "cannot set no_new_privs")
    argv = config["argv"]
    os.execve(argv[0], argv, config.get("env") or {})


main()
