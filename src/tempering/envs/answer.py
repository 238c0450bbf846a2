"""Answer matching: the model states a final answer, which is checked against the task's.

Checkers: `exact` (numbers compare numerically, other answers as stripped, case-folded text) and
`countdown` (an expression that uses each given number exactly once, only + - * and parentheses, and
equals the target - what its prompt says, `COUNTDOWN_RULES`; model text is parsed, never evaluated,
and at most MAX_EXPRESSION_CHARS of it). With `max_turns` > 1 a wrong answer is told so and the model may
try again. Built-in task generators for both: arithmetic expressions and Countdown puzzles.
"""

from __future__ import annotations

import ast
import math
import operator
import random
from collections import Counter

from tempering.envs.base import Environment, Step, register
from tempering.rewards.answers import extract_answer
from tempering.types import Task


def _number(text: str) -> float | None:
    try:
        value = float(text.replace(",", "").strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def answers_match(given: str, expected: object) -> bool:
    a, b = _number(given), _number(str(expected))
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return given.strip().casefold() == str(expected).strip().casefold()


MAX_EXPRESSION_CHARS = 200
"""Longer Countdown answers are refused unparsed (a few numbers and operators fit in far less)."""
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
COUNTDOWN_RULES = "use each number exactly once, with + - * and parentheses"
"""What the Countdown prompt asks for, and what `check_countdown` accepts."""


def evaluate_expression(text: str) -> tuple[int, list[int]]:
    """Value of an expression of integer literals joined by + - * (parentheses allowed), and the literals
    it uses in order. ValueError for anything else: division, unary minus, names, calls, other numbers."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError("not an arithmetic expression") from None
    used: list[int] = []

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("only the given numbers, + - * and parentheses are allowed")

    try:
        return ev(tree.body), used
    except RecursionError:  # 200 characters nest far less deep; kept for callers with other limits
        raise ValueError("expression nested too deeply") from None


def check_countdown(expression: str, numbers: list[int], target: int) -> tuple[bool, str]:
    """Whether `expression` reaches `target` using each of `numbers` exactly once (COUNTDOWN_RULES)."""
    try:
        value, used = evaluate_expression(expression)
    except ValueError as e:
        return False, str(e)
    extra, missing = Counter(used) - Counter(numbers), Counter(numbers) - Counter(used)
    if extra:
        return False, f"uses numbers not given (or more often than given): {sorted(extra.elements())}"
    if missing:
        return False, f"does not use every number: {sorted(missing.elements())} left"
    if value != target:
        return False, f"{expression.strip()} = {value}, not {target}"
    return True, ""


@register
class AnswerEnv(Environment):
    kind = "answer"
    components = outcome = frozenset({"correct"})
    default_weights = {"correct": 1.0}

    def reset(self, task: Task) -> str:
        self.task, self.turn = task, 0
        instruction = self.ctx.options.get("answer_instruction")
        return f"{task.prompt.rstrip()}\n\n{instruction}" if instruction else task.prompt

    def judge(self, answer: str) -> tuple[float, str]:
        """(score in [0, 1], why it is wrong)."""
        meta = self.task.metadata
        if meta.get("checker") == "countdown":
            ok, why = check_countdown(answer, meta["numbers"], meta["target"])
            return float(ok), why
        return float(answers_match(answer, self.task.answer)), "incorrect"

    def step(self, action: str) -> Step:
        self.turn += 1
        answer = extract_answer(action)
        score, why = self.judge(answer)
        success = score >= 1.0
        done = success or self.turn >= self.ctx.max_turns
        observation = None if done else f"# {why or 'incorrect'}, try again\n"
        return Step(observation, {"correct": score}, done, {"answer": answer}, success=success)


# ------------------------------------------------------------------------------------------ tasks


def arithmetic_task(rng: random.Random, index: int) -> Task:
    a, b, c = rng.randint(1, 20), rng.randint(1, 20), rng.randint(1, 9)
    op1, op2 = rng.choice("+-*"), rng.choice("+-")
    expression = f"{a}{op1}{b}{op2}{c}"
    return Task(
        id=f"arith-{index}",
        domain="arithmetic",
        env="answer",
        prompt=f"Compute: {expression}\nAnswer: ",
        answer=eval(expression),
        reference_solution=str(eval(expression)),
    )  # noqa: S307 (our own digits)


def countdown_task(rng: random.Random, index: int) -> Task:
    numbers = [rng.randint(1, 12) for _ in range(3)]
    a, b, c = numbers
    expression = rng.choice(
        [f"{a}+{b}+{c}", f"{a}*{b}+{c}", f"{a}*{b}-{c}", f"{a}+{b}*{c}", f"({a}+{b})*{c}"]
    )
    target = eval(expression)  # noqa: S307 (our own digits)
    shown = rng.sample(numbers, 3)
    prompt = (
        f"Numbers: {' '.join(map(str, shown))}. Target: {target}. {COUNTDOWN_RULES.capitalize()}.\nAnswer: "
    )
    return Task(
        id=f"countdown-{index}",
        domain="countdown",
        env="answer",
        prompt=prompt,
        answer=target,
        reference_solution=expression,
        metadata={"checker": "countdown", "numbers": numbers, "target": target},
    )


MAKERS = {"arithmetic": arithmetic_task, "countdown": countdown_task}


def generate_answer_tasks(
    num_train: int, num_heldout: int, seed: int, domains: list[str] | None = None
) -> tuple[list[Task], list[Task]]:
    """Arithmetic and Countdown tasks (round-robin over `domains`); held-out prompts never occur in training."""
    domains = domains or list(MAKERS)
    unknown = set(domains) - set(MAKERS)
    if unknown:
        raise ValueError(f"unknown answer domain(s) {sorted(unknown)}; valid: {', '.join(MAKERS)}")
    rng = random.Random(f"answer:{seed}")
    seen: set[str] = set()
    tasks: list[Task] = []
    i = 0
    while len(tasks) < num_train + num_heldout and i < 50 * (num_train + num_heldout):
        task = MAKERS[domains[i % len(domains)]](rng, i)
        i += 1
        if task.prompt not in seen:
            seen.add(task.prompt)
            tasks.append(task)
    return tasks[:num_train], tasks[num_train:]
