"""The data that flows between tempering's components.

Tasks and test cases are pydantic models because they are read from user files and must be validated;
everything produced inside a run (execution results, attempts, turns, episodes, reward results) is a plain
dataclass that pickles. Tensor batches (and the `Rollout` that carries one) live in `tempering.rollout.batch`,
next to the code that builds them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

# ----------------------------------------------------------------------------------------------- tasks


class TestCase(BaseModel):
    """One check of a program: a function call (`input` -> `output`) or a stdin/stdout exchange."""

    model_config = ConfigDict(extra="forbid")
    __test__ = False  # not a pytest test class

    name: str = ""
    """Shown in per-test results; defaults to `test_<index>`."""
    input: list[Any] | None = None
    """Positional arguments for the entry point (function-style tasks)."""
    output: Any = None
    """Expected return value of the entry point (JSON value; tuples compare equal to lists)."""
    stdin: str | None = None
    """Standard input for the whole program (stdin/stdout tasks)."""
    stdout: str | None = None
    """Expected standard output (compared after stripping trailing whitespace on each line)."""
    check: str | None = None
    """Python test code defining `check(candidate)` (the HumanEval convention), run in a separate process
    with `candidate` standing for the entry point; the test passes when `check` returns."""
    tags: list[str] = []
    """Free labels, e.g. `edge` for edge cases (weighted by process rewards)."""

    @model_validator(mode="after")
    def _one_style(self) -> TestCase:
        if sum(x is not None for x in (self.input, self.stdin, self.check)) != 1:
            raise ValueError(
                "a test case needs exactly one of 'input' (function call), 'stdin' (program) "
                "or 'check' (test code)"
            )
        if self.stdin is not None and self.stdout is None:
            raise ValueError("a stdin test case needs the expected 'stdout'")
        return self

    @property
    def is_call(self) -> bool:
        return self.input is not None

    @property
    def is_check(self) -> bool:
        return self.check is not None

    @property
    def style(self) -> str:
        return "call" if self.is_call else "check" if self.is_check else "stdin"


class Task(BaseModel):
    """A task: the prompt the policy sees, and how its answer is judged - hidden tests its program is executed
    against (`env: code`), an expected answer (`answer`, `reasoning_gym`), or the goal of a tool-use episode
    (`tool`, whose tools, services and goal live in `metadata`)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    """Unique within a task file."""
    domain: str
    """Task family, used for mixture weights and per-domain metrics."""
    prompt: str
    """Text given to the model; the completion is appended to it to form the program."""
    entry_point: str | None = None
    """Function the tests call; None for stdin/stdout tasks."""
    tests: list[TestCase] = []
    """Hidden tests: never shown to the model (code tasks)."""
    examples: list[TestCase] = []
    """The input/output examples shown in the prompt (used by the hard-coding guard)."""
    reference_solution: str | None = None
    """A correct program; used by SFT, by checks, and by RL only under `algo.guidance: reference`."""
    language: str = "python"
    """Language the completion is executed as."""
    env: str = "code"
    """Environment that runs an episode of the task (`tempering.envs`): code, answer, tool, reasoning_gym."""
    answer: Any = None
    """Expected final answer (answer-matching and tool tasks)."""
    metadata: dict[str, Any] = {}
    """Anything else (template name, difficulty, source; a tool task's tools and services)."""

    @model_validator(mode="after")
    def _consistent(self) -> Task:
        if self.env == "code" and not self.tests:
            raise ValueError("a code task needs at least one test")
        styles = {t.style for t in self.tests}
        if len(styles) > 1:
            raise ValueError(f"tests mix styles ({', '.join(sorted(styles))}); use one per task")
        if styles & {"call", "check"} and not self.entry_point:
            raise ValueError("function-call and check() tests need an 'entry_point'")
        return self


# ----------------------------------------------------------------------------------------- execution

ExecStatus = Literal[
    "ok",
    "runtime_error",
    "compile_error",
    "timeout",
    "memory_limit",
    "output_limit",
    "killed",
    "sandbox_error",
]
EXEC_STATUSES: tuple[str, ...] = ExecStatus.__args__  # type: ignore[attr-defined]


@dataclass
class TestResult:
    __test__ = False  # not a pytest test class

    name: str
    passed: bool
    error: str | None = None


@dataclass
class ExecResult:
    """What one sandboxed execution did."""

    status: str
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_time_s: float = 0.0
    cpu_time_s: float = 0.0
    max_rss_mb: float = 0.0
    tests: list[TestResult] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    """Suspicious behaviour seen by the harness (e.g. `exit_before_tests`, `non_builtin_output`)."""

    @property
    def passed_fraction(self) -> float:
        return sum(t.passed for t in self.tests) / len(self.tests) if self.tests else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.tests) and all(t.passed for t in self.tests)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExecResult:
        data = dict(data)
        data["tests"] = [TestResult(**t) for t in data.get("tests", [])]
        return cls(**data)


# ------------------------------------------------------------------------------------------ rollouts


@dataclass
class Attempt:
    """One program (or answer) an episode submitted for a task, with what executing it did."""

    task: Task
    group_id: int
    """Index of the task within its rollout batch; the `group_size` episodes of a task share it."""
    completion: str
    truncated: bool
    """True when generation hit `max_new_tokens` before the end-of-sequence token."""
    exec_result: ExecResult | None = None
    response_tokens: int = 0
    """Length of the completion in tokens (for length-based rewards such as DAPO's overlong shaping)."""
    example_result: ExecResult | None = None
    """The program run on the prompt's visible examples (when a guard or reward needs it)."""
    lint_findings: int | None = None
    """Linter findings in the completion (when the style reward needs them)."""
    reference_cpu_s: float | None = None
    """CPU time of the task's reference solution on the same tests (when the efficiency reward needs it)."""

    @property
    def program(self) -> str:
        return self.task.prompt + self.completion


@dataclass
class Turn:
    """One action of an episode and what the environment answered."""

    action: str
    observation: str | None
    """What came back (None when the episode ended with this action)."""
    rewards: dict[str, float]
    """The environment's reward components of this step."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form extras of the environment's step (a tool call's name, an answer)."""
    ended: bool = True
    """The action ended with the end-of-sequence token (else the token budget cut it)."""
    tokens: int = 0
    """Policy tokens of the action."""
    computed: int = 0
    """Context tokens the engine computed before sampling the action (the rest of the context came from
    its cache: a group's shared prompt, the episode's earlier turns)."""
    success: bool = False
    """The environment judged the task solved by this action."""
    attempt: Attempt | None = None
    """The program the action submitted and its execution (the code environment)."""
    passed: float | None = None
    """The attempt's test score as the `tests` reward gives it (0 when a guard caught it); None: no tests."""
    hacking: list[str] = field(default_factory=list)
    """The reward-hacking guards that flagged the attempt."""

    @property
    def status(self) -> str | None:
        """The execution status of the attempt (None: nothing was executed)."""
        return self.attempt.exec_result.status if self.attempt and self.attempt.exec_result else None


@dataclass
class Episode:
    """One scored episode as plain data: what crosses processes and goes into a checkpoint. The driver
    (`rollout.episodes`) keeps the live environment and conversation beside it, never in it."""

    task: Task
    group_id: int
    prompt_ids: list[int]
    default_weights: dict[str, float] = field(default_factory=dict)
    """Its environment's reward weights, used when `reward.weights` is unset."""
    outcome: frozenset[str] = frozenset()
    """Its environment's outcome components (read from the final step only)."""
    ids: list[int] = field(default_factory=list)
    """Every token after the prompt: actions and observations."""
    policy: list[bool] = field(default_factory=list)
    """True where `ids` holds a token the policy sampled."""
    logprobs: list[float] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    """Index in `ids` of the last token of each action."""
    turns: list[Turn] = field(default_factory=list)
    truncated: bool = False
    """The context budget ended the episode."""
    done: bool = False
    stopped: str | None = None
    """Why the `stop` rule ended the episode early (None: it did not)."""
    version: int = 0
    """The policy version that sampled the episode's actions."""
    proxy: dict[str, float] = field(default_factory=dict)
    """A run of the user's agent (`agent.episodes`): its session's `forks`, `token_exact_fraction`, `rerender_exact_fraction`, and
    whether it `failed` or hit its `timeout`; empty for the built-in driver's episodes."""

    @property
    def success(self) -> bool:
        return bool(self.turns and self.turns[-1].success)

    @property
    def first_success(self) -> bool:
        return bool(self.turns and self.turns[0].success)


@dataclass
class RewardResult:
    """A scalar reward plus the named components it was made of (each logged as reward/<name>/mean)."""

    score: float
    components: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
