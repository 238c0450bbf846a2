"""What went wrong with one attempt: a class a dashboard can count and a message a person (or the model) can read.

Classes, in the order they are decided:

    rejected        a reward-hacking guard caught the program (it read the tests, exited early, ...)
    passed          every hidden test passes
    syntax_error    the program does not compile
    timeout         the wall-clock or CPU limit ended it (or a test)
    memory          the memory limit ended it, or a test raised MemoryError
    output_limit    it wrote more than the output cap
    runtime_error   an exception: at import time (the traceback is kept), or raised by a test's call
    wrong_answer    every failing test returned, with the wrong value
    sandbox_error   the sandbox could not run it (not the program's fault)

Only visible examples' inputs, expected and actual values are named (the model saw them in its prompt);
for hidden tests only how many fail - the same rule as the code environment's feedback.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from tempering.envs.base import clip_middle
from tempering.envs.code import last_line, shareable_errors
from tempering.types import ExecResult

FAILURE_CLASSES = (
    "rejected",
    "passed",
    "syntax_error",
    "timeout",
    "memory",
    "output_limit",
    "runtime_error",
    "wrong_answer",
    "sandbox_error",
)
_EXCEPTION = re.compile(
    r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)|StopIteration|KeyboardInterrupt)\b"
)
_WRONG = (" expected ", "expected stdout", "returned a value", "assertion failed")


@dataclass
class Failure:
    kind: str
    """One of FAILURE_CLASSES."""
    message: str
    """One line: the exception, the first wrong value of a visible example, or how many hidden tests fail."""
    traceback: str = ""
    """The program's standard error when it died (head and tail kept), else empty."""
    visible: list[str] = field(default_factory=list)
    """Failing visible examples: `f(3) returned 3, expected 4` (input, actual, expected)."""
    hidden_failed: int = 0
    hidden_total: int = 0

    @property
    def signature(self) -> str:
        """What must repeat for an attempt to count as stuck on the previous one's error."""
        return f"{self.kind}|{self.message}|{self.hidden_failed}"

    def to_json(self) -> dict:
        return asdict(self)


def classify(
    hidden: ExecResult, examples: ExecResult | None = None, hacks: list[str] = (), traceback_chars: int = 2000
) -> Failure:
    """The class of an attempt from its execution on the hidden tests (`hidden`) and on the visible
    examples (`examples`, when they ran alongside), and the guards' detections."""
    failed = [t for t in hidden.tests if not t.passed]
    shown = [t for t in (examples.tests if examples else []) if not t.passed]
    counts = {"hidden_failed": len(failed), "hidden_total": len(hidden.tests)}
    visible = [_one_line(t.error or "failed") for t in shown]
    errors = [t.error or "" for t in failed + shown]  # for deciding the class; only `safe` is ever shown
    safe = shareable_errors(failed) + [last_line(t.error) for t in shown if t.error]
    stderr = clip_middle(hidden.stderr.strip(), traceback_chars) if hidden.status != "ok" else ""
    died = _first_exception(hidden.stderr) or next((e for e in safe if e), "")

    def failure(kind: str, message: str) -> Failure:
        return Failure(kind, message, stderr, visible, **counts)

    if hacks:
        return failure("rejected", f"rejected by the reward-hacking guards: {', '.join(hacks)}")
    if hidden.all_passed:
        return failure("passed", f"all {len(hidden.tests)} tests pass")
    status = hidden.status
    if status == "compile_error" or died.startswith(("SyntaxError", "IndentationError", "TabError")):
        return failure("syntax_error", died or "the program does not compile")
    if status == "timeout" or any("timed out" in e for e in errors):
        return failure("timeout", "timed out" + (f": {died}" if died and "timed out" not in died else ""))
    if status == "memory_limit" or any(last_line(e).startswith("MemoryError") for e in errors):
        return failure("memory", died or "memory limit exceeded")
    if status == "output_limit":
        return failure("output_limit", "the program wrote more output than allowed")
    if status in ("sandbox_error", "killed") and not any(_EXCEPTION.match(last_line(e)) for e in errors):
        return failure("sandbox_error", died or status)
    raised = [e for e in safe if _EXCEPTION.match(e)]
    if status == "runtime_error" or raised:
        # Died at import: the traceback's own exception (the harness may add one after it); else a test's.
        message = died if status == "runtime_error" and died else raised[0] if raised else died
        return failure("runtime_error", message or "the program raised an exception")
    if not hidden.tests:
        return failure("sandbox_error", "no test ran")
    wrong = [v for v in visible if any(w in f" {v}" for w in _WRONG)]
    message = wrong[0] if wrong else f"{len(failed)} of {len(hidden.tests)} hidden tests fail"
    return failure("wrong_answer", message)


def _first_exception(stderr: str) -> str:
    """The first exception line of a traceback (the cause; a harness may add its own after it), else the
    last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return next((line for line in lines if _EXCEPTION.match(line)), lines[-1] if lines else "")


def _one_line(text: str) -> str:
    return " ".join(text.split())
