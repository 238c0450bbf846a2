"""Adversarial programs, one property per test. Each test asserts that the host is unharmed and that
nothing is left behind: no process outlives the execution and the scratch area is empty again.

Most properties hold for both backends; the ones that need namespaces (network, host files, disk) are
asserted for bubblewrap and documented as off for the process fallback (see `tempering sandbox doctor`).
"""

import os
import shutil
import socket
import time

import pytest

from tempering.sandbox import LocalSandbox, SandboxLimits, isolation
from tempering.types import Task, TestCase

BACKENDS = ["bwrap", "process"] if shutil.which("bwrap") else ["process"]


@pytest.fixture(scope="module", params=BACKENDS)
def sb(request):
    with LocalSandbox(SandboxLimits(timeout_s=2.0, cpu_s=2.0), workers=1, isolation=request.param) as sandbox:
        yield sandbox


def needs_bwrap(sb):
    if sb.backend != "bwrap":
        pytest.skip("needs the namespaces of the bubblewrap backend (off in the process fallback)")


def worker_tree(sb) -> set[int]:
    """Host pids of every process under the sandbox's workers (the workers included)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    roots = [w.proc.pid for w in list(sb._idle.queue)]
    found, stack = set(), roots
    while stack:
        pid = stack.pop()
        found.add(pid)
        stack += children.get(pid, [])
    return found


def assert_clean(sb, baseline: set[int]) -> None:
    """Only the worker processes remain, and the next execution finds an empty scratch area."""
    deadline = time.monotonic() + 2
    while worker_tree(sb) - baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_tree(sb) - baseline == set(), "a process outlived its execution"
    r = sb.run(
        "import os\nprint(sorted(set(os.listdir('..')) - {os.path.basename(os.getcwd())}), os.listdir('.'))"
    )
    assert r.status == "ok" and r.stdout.strip() == "[] []", r


@pytest.fixture()
def baseline(sb):
    return worker_tree(sb)


def call_task(tests, entry="f"):
    return Task(
        id="t",
        domain="d",
        prompt="",
        entry_point=entry,
        tests=[TestCase(name=f"t{i}", input=list(a), output=o) for i, (a, o) in enumerate(tests)],
    )


def check_task(checks, entry="f"):
    return Task(id="c", domain="d", prompt="", entry_point=entry, tests=[TestCase(check=c) for c in checks])


CHECK = "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(5) == 25\n"


# ------------------------------------------------------------------------------ resources and time


def test_infinite_loop(sb, baseline):
    start = time.monotonic()
    assert sb.run("while True: pass", timeout_s=0.5).status == "timeout"
    assert time.monotonic() - start < 3
    assert_clean(sb, baseline)


def test_loop_ignoring_sigterm(sb, baseline):
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(0.01)"
    assert sb.run(code, timeout_s=0.5).status == "timeout"
    assert_clean(sb, baseline)


def test_fork_bomb(sb, baseline):
    if sb.backend == "process" and os.geteuid() != 0:
        pytest.skip("RLIMIT_NPROC counts the whole uid when the host is not root")
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = sb.run(code, timeout_s=1.0)
    assert r.status in ("timeout", "runtime_error")
    assert_clean(sb, baseline)


def test_thread_bomb(sb, baseline):
    code = (
        "import threading, time\nn = 0\n"
        "try:\n    while True:\n        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "        n += 1\nexcept (RuntimeError, MemoryError):\n    print('stopped at', n)\n"
    )
    r = sb.run(code, timeout_s=2.0)
    assert r.status in ("ok", "timeout", "memory_limit", "runtime_error")
    if r.status == "ok":
        assert int(r.stdout.split()[-1]) < 200  # a limit stopped it, not the clock
    assert_clean(sb, baseline)


def test_memory_bomb(sb, baseline):
    r = sb.run("x = []\nwhile True:\n    x.append(bytearray(16 << 20))", memory_mb=128)
    assert r.status == "memory_limit"
    assert_clean(sb, baseline)


def test_a_gigabyte_of_stdout(sb, baseline):
    start = time.monotonic()
    r = sb.run("import sys\nblock = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(block)")
    assert r.status == "output_limit" and r.stdout_truncated
    assert len(r.stdout) == sb.limits.max_output_bytes
    assert time.monotonic() - start < 3
    assert_clean(sb, baseline)


def test_filling_the_disk(sb, baseline):
    code = (
        "import os\nn = 0\ntry:\n    for i in range(10_000):\n"
        "        with open(f'f{i}', 'wb') as f:\n            f.write(b'x' * (8 << 20))\n        n += 1\n"
        "except OSError as e:\n    print('stopped after', n, type(e).__name__)\n"
    )
    if sb.backend == "process":
        # Only RLIMIT_FSIZE binds here: prove that one file cannot exceed it, without filling the host's disk.
        r = sb.run("open('big', 'wb').write(b'x' * (64 << 20))", memory_mb=512)
        assert r.status == "runtime_error" and "File too large" in r.stderr  # EFBIG: Python ignores SIGXFSZ
    else:
        free_before = shutil.disk_usage("/").free
        r = sb.run(code, timeout_s=5.0)
        assert r.status == "ok" and "stopped after" in r.stdout, r
        assert int(r.stdout.split()[2]) * 8 <= 64  # the scratch tmpfs is 64 MiB
        assert abs(shutil.disk_usage("/").free - free_before) < (256 << 20)
    assert_clean(sb, baseline)


def test_flooding_the_scratch_with_empty_files(sb, baseline):
    """Empty files cost no bytes but a kernel inode each: the scratch tmpfs caps their number too."""
    if not sb.isolation.uid_split:
        pytest.skip(
            f"needs the two-uid launcher: {sb.isolation.why_not_split} (`tempering sandbox doctor` says so)"
        )
    code = (
        "import os\nn = 0\ntry:\n    for i in range(50_000):\n        open(f'f{i}', 'w').close()\n        n += 1\n"
        "except OSError as e:\n    print('stopped after', n, e.strerror)\nelse:\n    print('created', n)\n"
    )
    r = sb.run(code, timeout_s=10.0)
    assert r.status == "ok" and r.stdout.startswith("stopped after"), r
    assert int(r.stdout.split()[2]) < sb.isolation.scratch_inodes and "No space left" in r.stdout
    assert_clean(sb, baseline)


def test_a_private_tmpfs_outside_the_caps(sb, baseline):
    """A program may not make a user namespace of its own, where it could mount an uncapped tmpfs."""
    if not sb.isolation.uid_split:
        pytest.skip(
            f"needs the two-uid launcher: {sb.isolation.why_not_split} (`tempering sandbox doctor` says so)"
        )
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x10000000 | 0x00020000), os.strerror(ctypes.get_errno()))\n"
        "print(libc.mount(b'tmpfs', b'.', b'tmpfs', 0, b'size=1g'), os.strerror(ctypes.get_errno()))\n"
    )
    r = sb.run(code)
    assert (
        r.status == "ok"
        and r.stdout.splitlines()[0].startswith("-1")
        and r.stdout.splitlines()[1].startswith("-1")
    )
    assert_clean(sb, baseline)


# ----------------------------------------------------------------------------------- host integrity


def test_writing_outside_the_working_directory(sb, baseline, tmp_path):
    target = tmp_path / "planted"
    code = (
        "import os\nwrote = []\n"
        f"for p in [{str(target)!r}, '/etc/planted', '/usr/planted', '/planted', '/dev/planted']:\n"
        "    try:\n        open(p, 'w').write('x')\n        wrote.append(p)\n    except OSError:\n        pass\n"
        "print(wrote)\n"
    )
    r = sb.run(code)
    assert r.status == "ok"
    assert not target.exists() and not os.path.exists("/etc/planted") and not os.path.exists("/usr/planted")
    assert not os.path.exists("/planted")
    assert "file_outside_scratch" in r.flags
    assert_clean(sb, baseline)


def test_reading_host_secrets(sb, baseline, tmp_path, monkeypatch):
    if sb.backend == "process" and os.geteuid() != 0:
        pytest.skip("the process fallback reads what the host user can read")
    secret_dir = tmp_path / ".ssh"
    secret_dir.mkdir()
    (secret_dir / "id_ed25519").write_text("hunter2-key")
    os.chmod(tmp_path, 0o700)
    monkeypatch.setenv("TEMPERING_SECRET", "hunter2-env")
    with LocalSandbox(workers=1, isolation=sb.backend) as fresh:  # started after the variable was set
        code = (
            "import os, glob\nout = [repr(dict(os.environ))]\n"
            f"for p in [{str(secret_dir / 'id_ed25519')!r}, '/proc/1/environ', '/proc/self/environ', "
            "'/etc/shadow', os.path.expanduser('~/.ssh/id_rsa')] + glob.glob('/root/.ssh/*'):\n"
            "    try:\n        out.append(open(p).read())\n    except OSError as e:\n        out.append(str(e))\n"
            "print(out)\n"
        )
        r = fresh.run(code)
    assert r.status == "ok"
    assert "hunter2" not in r.stdout and "root:" not in r.stdout
    assert_clean(sb, baseline)


def test_killing_the_parent_and_everything(sb, baseline):
    code = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)\n"
    r = sb.run(code)
    if sb.backend == "bwrap":
        assert r.status in ("ok", "runtime_error")  # the worker is PID 1 of its namespace: immune
    else:
        assert r.status in ("killed", "ok", "runtime_error")
    assert os.getppid() > 1  # the host (this test process) lives on
    assert sb.run("print(1)").stdout == "1\n"  # and the sandbox still serves
    assert_clean(sb, worker_tree(sb))


def test_connecting_to_a_loopback_listener(sb, baseline):
    needs_bwrap(sb)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    code = (
        "import socket\ntry:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')\n    print('connected')\n"
        "except OSError as e:\n    print('refused', e)\n"
    )
    r = sb.run(code)
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()
    assert r.status == "ok" and r.stdout.startswith("refused") and "network_attempt" in r.flags
    assert_clean(sb, baseline)


def test_a_daemon_does_not_outlive_the_run(sb, baseline):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(30)\n        os._exit(0)\n    os._exit(0)\n"
        "time.sleep(0.1)\nprint('detached')\n"
    )
    r = sb.run(code)
    assert r.status == "ok" and r.stdout == "detached\n"
    assert_clean(sb, baseline)


# ------------------------------------------------------------------------------ the test harness


@pytest.mark.parametrize(
    "code", ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n", "def f(x):\n    raise SystemExit(0)\n"]
)
def test_exit_before_the_tests(sb, baseline, code):
    for task in (call_task([((2,), 4)]), check_task([CHECK])):
        r = sb.run_tests(task, code)
        assert not r.tests[0].passed and r.flags
    assert_clean(sb, baseline)


def test_patched_builtins_and_comparison(sb, baseline):
    code = (
        "import builtins, operator\nbuiltins.repr = lambda v: '4'\nbuiltins.isinstance = lambda *a: True\n"
        "operator.eq = lambda a, b: True\nbuiltins.AssertionError = KeyboardInterrupt\n"
        "def f(x):\n    return 0\n"
    )
    for task in (call_task([((2,), 4)]), check_task([CHECK])):
        r = sb.run_tests(task, code)
        assert not r.tests[0].passed
    assert "patched_builtins" in sb.run_tests(call_task([((2,), 4)]), code).flags
    assert_clean(sb, baseline)


def test_always_equal_objects(sb, baseline):
    code = (
        "class Anything(int):\n    def __eq__(self, other): return True\n    __hash__ = int.__hash__\n"
        "def f(x):\n    return Anything(0)\n"
    )
    for task in (call_task([((2,), 4)]), check_task([CHECK])):
        r = sb.run_tests(task, code)
        assert not r.tests[0].passed and "non_builtin_output" in r.flags
    assert_clean(sb, baseline)


def test_printed_fake_verdicts(sb, baseline):
    code = (
        'import os\nprint(\'test_0 passed\\nALL TESTS PASSED\\n{"i": 0, "ok": true}\')\n'
        'os.write(3, b\'{"i": 0, "ok": true, "value": "4"}\\n{"event": "done"}\\n\')\n'
        "def f(x):\n    return 0\n"
    )
    for task in (call_task([((2,), 4)]), check_task([CHECK])):
        r = sb.run_tests(task, code)
        assert not r.tests[0].passed and "result_channel_tampered" in r.flags, r
    assert_clean(sb, baseline)


def test_reading_or_rewriting_the_test_file(sb, baseline):
    # The check code is never a file, and never in the program's memory: search both.
    code = (
        "import os, gc\nfound = []\n"
        "for root in ['.', '..']:\n"
        "    for dirpath, _, files in os.walk(root):\n"
        "        for name in files:\n"
        "            try:\n                data = open(os.path.join(dirpath, name), 'rb').read()\n"
        "            except OSError:\n                continue\n"
        "            if b'SENTINEL_EXPECTED' in data:\n                found.append(name)\n"
        "if any('SENTINEL_EXPECTED' in o for o in gc.get_objects() if isinstance(o, str)):\n    found.append('gc')\n"
        "for d in ['test.py', '../test.py', 'tests.py']:\n"
        "    try:\n        open(d, 'w').write('def check(c): pass')\n    except OSError:\n        pass\n"
        "print(found)\n"
        "def f(x):\n    return 0\n"
    )
    checks = [
        "def check(candidate):\n    SENTINEL_EXPECTED = 4\n    assert candidate(2) == SENTINEL_EXPECTED\n"
    ]
    for _ in range(2):  # the second run is forked from a server that has handled the first's tests
        r = sb.run_tests(check_task(checks), code)
        assert r.stdout.strip() == "[]" and not r.tests[0].passed, r
    assert_clean(sb, baseline)


def test_check_tests_pass_a_correct_program(sb, baseline):
    r = sb.run_tests(
        check_task([CHECK, "def check(c):\n    assert c(0) == 1\n"]), "def f(x):\n    return x * x\n"
    )
    assert [t.passed for t in r.tests] == [True, False] and r.status == "ok" and not r.flags, r
    assert "assertion failed" in r.tests[1].error
    assert_clean(sb, baseline)


# ------------------------------------------------------------------------------------ the worker itself

# Each program attacks its fork server (its parent, or PID 1 under bubblewrap) and everything else it can
# name. It refuses to run as root, so that a broken uid switch can never turn it loose on the host.
GUARD = "import os, signal, ctypes, resource\nassert os.getuid() != 0, 'UNSAFE: the program runs as root'\n"
TARGETS = (
    "me = os.getpid()\npids = {os.getppid(), 1} | {int(p) for p in os.listdir('/proc') if p.isdigit()}\n"
    "pids -= {me, 0}\n"
)
SABOTAGE = {
    "prlimit": GUARD
    + TARGETS
    + (
        "for pid in [os.getppid(), 1] + sorted(pids):\n"
        "    for r in (resource.RLIMIT_NOFILE, resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_NPROC,\n"
        "              resource.RLIMIT_FSIZE, resource.RLIMIT_STACK, resource.RLIMIT_DATA):\n"
        "        try:\n            resource.prlimit(pid, r, (1, 1))\n        except OSError:\n            pass\n"
        "print('done')\n"
    ),
    "signals": GUARD
    + TARGETS
    + (
        "for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGKILL):\n"
        "    for pid in [os.getppid(), 1] + sorted(pids):\n"
        "        try:\n            os.kill(pid, sig)\n        except OSError:\n            pass\n"
        "print('done')\n"
    ),
    "ptrace": GUARD
    + (
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for pid in (os.getppid(), 1):\n"
        "    for request in (16, 0x4206):  # PTRACE_ATTACH, PTRACE_SEIZE\n"
        "        libc.ptrace(request, pid, 0, 0)\n"
        "    for path in (f'/proc/{pid}/mem', f'/proc/{pid}/environ'):\n"
        "        try:\n            open(path, 'r+b').write(b'x')\n        except OSError:\n            pass\n"
        "print('done')\n"
    ),
}


@pytest.mark.parametrize("attack", sorted(SABOTAGE))
def test_a_program_cannot_sabotage_its_server(attack):
    """Lowering the server's limits, signalling or tracing it leaves the next 100 executions all ok; with
    two uids per worker (a root host) no worker even needed replacing."""
    for backend in BACKENDS:
        with LocalSandbox(SandboxLimits(timeout_s=2.0, cpu_s=2.0), workers=2, isolation=backend) as pool:
            attacks = pool.run_batch([pool.request(SABOTAGE[attack]) for _ in range(4)])
            assert all(r.status != "sandbox_error" for r in attacks), attacks
            assert not any("UNSAFE" in r.stderr for r in attacks)
            results = pool.run_batch([pool.request(f"print({i})") for i in range(100)])
            assert [(r.status, r.stdout) for r in results] == [("ok", f"{i}\n") for i in range(100)]
            if pool.isolation.uid_split:
                assert [r.status for r in attacks] == ["ok"] * 4 and pool.replaced == 0, attacks


@pytest.mark.parametrize("attack", ["prlimit", "signals"])
def test_a_worker_sharing_its_programs_uid_is_replaced_when_damaged(attack, monkeypatch):
    """The fallback where program and server share one uid (a non-root host; forced here): the damage is
    detected, the attack is reported as `killed` (never sandbox_error), and the next 100 executions are ok."""
    monkeypatch.setattr(isolation, "_split_works", lambda python: "forced off by the test")
    for backend in BACKENDS:
        with LocalSandbox(SandboxLimits(timeout_s=2.0, cpu_s=2.0), workers=2, isolation=backend) as pool:
            assert not pool.isolation.uid_split
            attacks = pool.run_batch([pool.request(SABOTAGE[attack]) for _ in range(4)])
            assert all(r.status in ("ok", "killed", "runtime_error") for r in attacks), attacks
            if attack == "prlimit":  # PID 1 ignores the signals; a plain process worker dies or stops
                assert all(r.status == "killed" and "worker_tampered" in r.flags for r in attacks), attacks
            results = pool.run_batch([pool.request(f"print({i})") for i in range(100)])
            assert [(r.status, r.stdout) for r in results] == [("ok", f"{i}\n") for i in range(100)]


def test_a_program_that_breaks_its_worker_never_answers_for_another_request(monkeypatch):
    """Programs that stop, kill or cripple their shared-uid worker, interleaved with tagged programs on the
    same pool: every tagged program gets its own output, never an answer meant for another request."""
    monkeypatch.setattr(isolation, "_split_works", lambda python: "forced off by the test")
    for backend in BACKENDS:
        with LocalSandbox(SandboxLimits(timeout_s=2.0, cpu_s=2.0), workers=2, isolation=backend) as pool:
            attacks = [SABOTAGE["signals"], SABOTAGE["prlimit"]]
            reqs = [
                pool.request(attacks[i % 2] if i % 3 == 0 else f"print('request {i}')") for i in range(24)
            ]
            results = pool.run_batch(reqs)
            tagged = [(i, r.status, r.stdout) for i, r in enumerate(results) if i % 3]
            assert tagged == [(i, "ok", f"request {i}\n") for i in range(24) if i % 3], tagged
            assert not any("request" in r.stdout for i, r in enumerate(results) if i % 3 == 0)
            assert pool.replaced > 0  # the attacks did break workers
