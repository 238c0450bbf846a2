"""Each sandbox guarantee of the first version, attacked by a program of its own."""

import os
import shutil
import threading
import time
from dataclasses import asdict, replace

import pytest

from tempering.errors import SandboxError
from tempering.sandbox import LocalSandbox, SandboxLimits, compare_values, parse_value, pool
from tempering.types import Task, TestCase


def call_task(tests, entry="f"):
    return Task(
        id="t",
        domain="d",
        prompt="",
        entry_point=entry,
        tests=[TestCase(name=f"t{i}", input=list(a), output=o) for i, (a, o) in enumerate(tests)],
    )


def test_ok_program_reports_output_and_usage(sandbox):
    r = sandbox.run("import sys\nprint('hi')\nprint('err', file=sys.stderr)")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("ok", 0, "hi\n", "err\n")
    assert r.wall_time_s > 0 and r.max_rss_mb > 0


def test_stdin_is_fed(sandbox):
    assert sandbox.run("print(input()[::-1])", stdin="abc\n").stdout == "cba\n"


def test_infinite_loop_times_out(sandbox):
    start = time.monotonic()
    r = sandbox.run("while True: pass", timeout_s=0.5)
    assert r.status == "timeout"
    assert time.monotonic() - start < 3


def test_loop_ignoring_sigterm_still_dies(sandbox):
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(0.01)"
    assert sandbox.run(code, timeout_s=0.5).status == "timeout"


def test_memory_bomb_hits_the_limit(sandbox):
    r = sandbox.run("x = bytearray(2 * 1024**3)", memory_mb=128)
    assert r.status == "memory_limit"


def test_crash_is_a_runtime_error_with_traceback(sandbox):
    r = sandbox.run("def g():\n    return 1 / 0\ng()")
    assert r.status == "runtime_error" and r.exit_code == 1
    assert "ZeroDivisionError" in r.stderr
    r = sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert r.status == "runtime_error" and r.signal == 11


def test_output_flood_is_cut_and_flagged(sandbox):
    start = time.monotonic()
    r = sandbox.run("import sys\nwhile True: sys.stdout.write('x' * 65536)")
    assert r.status == "output_limit" and r.stdout_truncated
    assert len(r.stdout) == sandbox.limits.max_output_bytes
    assert time.monotonic() - start < 3


def test_compile_error(sandbox):
    r = sandbox.run("def f(:\n    pass")
    assert r.status == "compile_error" and "SyntaxError" in r.stderr


def test_host_environment_is_invisible(sandbox, monkeypatch):
    monkeypatch.setenv("TEMPERING_TEST_SECRET", "hunter2")
    with LocalSandbox(workers=1) as fresh:  # started after the variable was set
        r = fresh.run("import os\nprint(dict(os.environ))\nprint(open('/proc/self/environ').read())")
    assert "hunter2" not in r.stdout and r.status == "ok"


def test_scratch_directory_is_fresh_and_removed(sandbox):
    r1 = sandbox.run("import os\nopen('mine.txt', 'w').write('x')\nprint(os.getcwd())")
    cwd = r1.stdout.strip()
    assert not os.path.exists(cwd)
    r2 = sandbox.run("import os\nprint(os.listdir('.'))")
    assert r2.stdout.strip() == "[]"


def test_background_child_in_the_process_group_is_killed(sandbox, tmp_path):
    marker = tmp_path / "alive"
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    time.sleep(1.0)\n"
        f"    open({str(marker)!r}, 'w').write('still here')\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    r = sandbox.run(code)
    assert r.status == "ok"
    time.sleep(1.5)
    assert not marker.exists()


def test_function_tests_verdicts_per_test(sandbox):
    task = call_task([((1,), 2), ((5,), 6), ((0,), 1)])
    r = sandbox.run_tests(task, "def f(x):\n    return x + 1 if x else 7\n")
    assert [t.passed for t in r.tests] == [True, True, False]
    assert "returned 7, expected 1" in r.tests[2].error
    assert r.passed_fraction == 2 / 3


def test_exit_before_tests_cannot_pass(sandbox):
    task = call_task([((1,), 2)])
    for code in (
        "import sys\nsys.exit(0)\n",
        "import os\nos._exit(0)\n",
        "def f(x):\n    raise SystemExit(0)\n",
    ):
        r = sandbox.run_tests(task, code)
        assert not r.tests[0].passed, code
        assert r.flags, code


def test_always_equal_object_cannot_pass(sandbox):
    code = (
        "class Anything:\n    def __eq__(self, other): return True\n    __hash__ = object.__hash__\n"
        "def f(x):\n    return Anything()\n"
    )
    r = sandbox.run_tests(call_task([((1,), 2)]), code)
    assert not r.tests[0].passed and "non_builtin_output" in r.flags
    int_subclass = "class I(int):\n    def __eq__(self, o): return True\ndef f(x):\n    return I(0)\n"
    assert not sandbox.run_tests(call_task([((1,), 2)]), int_subclass).tests[0].passed


def test_printed_fake_verdicts_and_patched_builtins_do_not_pass(sandbox):
    code = (
        "import builtins\nbuiltins.repr = lambda v: '2'\nbuiltins.isinstance = lambda *a: True\n"
        "print('test_0 passed\\nALL TESTS PASSED')\ndef f(x):\n    return 0\n"
    )
    r = sandbox.run_tests(call_task([((1,), 2)]), code)
    assert not r.tests[0].passed and "patched_builtins" in r.flags


def test_stdin_stdout_task(sandbox):
    task = Task(
        id="io",
        domain="d",
        prompt="",
        tests=[TestCase(stdin="3\n", stdout="6"), TestCase(stdin="5\n", stdout="10\n")],
    )
    r = sandbox.run_tests(task, "print(int(input()) * 2)")
    assert r.all_passed
    r = sandbox.run_tests(task, "print(6)")
    assert [t.passed for t in r.tests] == [True, False]


def test_run_batch_keeps_order_and_runs_in_parallel():
    with LocalSandbox(SandboxLimits(timeout_s=2), workers=2) as sb:
        reqs = [sb.request(f"import time\ntime.sleep(0.3)\nprint({i})") for i in range(4)]
        start = time.monotonic()
        results = sb.run_batch(reqs)
        elapsed = time.monotonic() - start
    assert [r.stdout.strip() for r in results] == ["0", "1", "2", "3"]
    assert elapsed < 4 * 0.3  # two workers overlap the sleeps


def test_a_dead_worker_is_replaced(sandbox):
    with LocalSandbox(workers=1) as sb:
        worker = sb._idle.get()
        worker.proc.kill()
        worker.proc.wait()
        sb._idle.put(worker)
        assert sb.run("print(1)").status == "killed"
        assert sb.run("print(1)").stdout == "1\n"


def test_an_answer_left_in_the_pipe_is_never_taken_for_another_request():
    """An answer the host did not ask for (here a stray request pushed into the worker's pipe, as a lost
    answer would be) does not become the next request's result: answers carry their request's id."""
    with LocalSandbox(workers=1) as sb:
        worker = sb._idle.queue[0]
        stray = {"kind": "program", "code": "print('stale')", "language": "python", **asdict(sb.limits)}
        worker.proc.stdin.write(pool._frame(stray))
        worker.proc.stdin.flush()
        mine = sb.run("print('mine')")
        assert (
            mine.stdout != "stale\n" and mine.status == "sandbox_error" and "answered request" in mine.stderr
        )
        assert sb.run("print('next')").stdout == "next\n" and sb.replaced == 1


def test_a_request_that_breaks_the_hosts_wait_leaks_nothing(monkeypatch):
    """An unexpected error while the host waits (a NaN deadline made select() raise) retires the worker:
    its late answer never reaches the next request, from this client or any other."""
    with LocalSandbox(workers=1) as sb:
        real, calls = pool.select.select, []

        def broken_once(*args):
            calls.append(1)
            if len(calls) == 1:
                raise ValueError("Invalid value NaN (not a number)")
            return real(*args)

        monkeypatch.setattr(pool.select, "select", broken_once)
        with pytest.raises(ValueError, match="NaN"):
            sb.run("print('first')")
        assert sb.run("print('second')").stdout == "second\n" and sb.replaced == 1


@pytest.mark.parametrize(
    "limit, value",
    [
        ("timeout_s", float("nan")),
        ("timeout_s", 0),
        ("cpu_s", -1.0),
        ("compile_timeout_s", float("inf")),
        ("memory_mb", 0),
        ("max_file_bytes", -1),
        ("max_output_bytes", 1.5),
        ("max_processes", True),
    ],
)
def test_impossible_limits_never_reach_a_worker(sandbox, limit, value):
    """NaN breaks the host's wait, 0 or less kills every program, -1 is no RLIMIT_FSIZE at all: refused."""
    req = replace(sandbox.request("print(1)"), limits=replace(sandbox.limits, **{limit: value}))
    with pytest.raises(SandboxError, match=f"limits.{limit} must be a .* number above 0"):
        sandbox.execute(req)
    assert sandbox.run("print(2)").stdout == "2\n"


BACKENDS = ["bwrap", "process"] if shutil.which("bwrap") else ["process"]
SET_PROGRAM = "import time\ntime.sleep(0.05)\nprint(set(f'key{i}' for i in range(30)), hash('tempering'))\n"


def test_set_order_is_the_same_on_every_worker():
    """Every worker of every backend has the same hash seed: a set prints the same everywhere."""
    outputs = set()
    for backend in BACKENDS:
        for _ in range(2):  # two pools: other worker processes
            with LocalSandbox(workers=4, isolation=backend) as sb:
                results = sb.run_batch([sb.request(SET_PROGRAM) for _ in range(12)])
            assert all(r.status == "ok" for r in results), results
            outputs |= {r.stdout for r in results}
    assert len(outputs) == 1, outputs


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pool_outlives_the_thread_that_started_it(backend):
    """A worker dies with the *thread* that started it (parent-death signal): workers are started by the
    pool's own long-lived thread, so a pool made (or a worker replaced) in a short-lived thread lives on."""
    made = []
    thread = threading.Thread(target=lambda: made.append(LocalSandbox(workers=1, isolation=backend)))
    thread.start()
    thread.join()
    with made[0] as sb:
        time.sleep(0.2)
        assert sb.run("print(1)").stdout == "1\n"
        worker = sb._idle.get()
        worker.broken = True  # replaced on next use, from a thread that then ends
        sb._idle.put(worker)
        thread = threading.Thread(target=lambda: sb.run("print(2)"))
        thread.start()
        thread.join()
        time.sleep(0.2)
        assert sb.run("print(3)").stdout == "3\n" and sb.replaced == 1


HELLO = {
    "python": "print(6 * 7)",
    "c": '#include <stdio.h>\nint main(void) { printf("%d\\n", 6 * 7); return 0; }\n',
    "cpp": "#include <iostream>\nint main() { std::cout << 6 * 7 << std::endl; }\n",
    "javascript": "console.log(6 * 7)",
    "bash": "f=$(mktemp) && echo $((6 * 7)) > $f && cat $f",  # /tmp is writable, as programs expect
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_language_runs_as_the_program_uid(backend):
    """Compilers and interpreters run under the program's uid, which must still reach what they need
    (a directory the container creates 0700 for its own uid would not do)."""
    with LocalSandbox(workers=1, isolation=backend) as sb:
        for language, code in HELLO.items():
            r = sb.run(code, language=language, timeout_s=10)
            assert (r.status, r.stdout, r.stderr) == ("ok", "42\n", ""), (language, r)


def test_value_comparison():
    assert compare_values(parse_value("(1, [2, 3])"), [1, [2, 3]])
    assert compare_values(parse_value("0.30000000000000004"), 0.3)
    assert not compare_values(parse_value("{'a': 1}"), {"a": 2})
    assert not compare_values(parse_value("[1, 2]"), [1, 2, 3])
    assert compare_values(parse_value("inf"), float("inf"))
