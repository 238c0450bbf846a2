"""Answer matching: the model states a final answer, which is checked against the task's.

Checkers: `exact` (numbers compare numerically, other answers as stripped, case-folded text) and
`countdown` (an arithmetic expression that uses the given numbers, each at most once, and reaches the
target). With `max_turns` > 1 a wrong answer is told so and the model may try again. Built-in task
generators for both: arithmetic expressions and Countdown puzzles.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from collections import Counter

from tempering.envs.base import Environment, Step, register
from tempering.types import Task

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def extract_answer(action: str) -> str:
    """The answer in an action: inside the last `<answer>...</answer>`, else the text after the last
    `Answer:`, else the whole text - stripped (answers may span lines: a matrix, a grid)."""
    tagged = _ANSWER_TAG.findall(action)
    if tagged:
        return tagged[-1].strip()
    return action.rsplit("Answer:", 1)[-1].strip()


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


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate_expression(text: str) -> tuple[float, list[int]]:
    """Value of a + - * / expression of integer literals, and the literals it uses. ValueError otherwise."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    used: list[int] = []

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](left, right)
        raise ValueError("only integers, + - * / and parentheses are allowed")

    return ev(tree.body), used


def check_countdown(expression: str, numbers: list[int], target: int) -> tuple[bool, str]:
    try:
        value, used = evaluate_expression(expression)
    except ValueError as e:
        return False, str(e)
    if Counter(used) - Counter(numbers):
        return False, f"uses numbers not given: {sorted((Counter(used) - Counter(numbers)).elements())}"
    if not math.isclose(value, target):
        return False, f"{expression.strip()} = {value:g}, not {target}"
    return True, ""


@register
class AnswerEnv(Environment):
    kind = "answer"
    outcome = frozenset({"correct"})
    default_weights = {"correct": 1.0}

    def reset(self, task: Task) -> str:
        self.task, self.turn = task, 0
        return task.prompt

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
        return Step(observation, {"correct": score}, done, {"success": success, "answer": answer})


# ------------------------------------------------------------------------------------------ tasks


def arithmetic_task(rng: random.Random, index: int) -> Task:
    a, b, c = rng.randint(1, 20), rng.randint(1, 20), rng.randint(1, 9)
    op1, op2 = rng.choice("+-*"), rng.choice("+-")
    expression = f"{a}{op1}{b}{op2}{c}"
    return Task(id=f"arith-{index}", domain="arithmetic", env="answer", prompt=f"Compute: {expression}\nAnswer: ",
                answer=eval(expression), reference_solution=str(eval(expression)))  # noqa: S307 (our own digits)


def countdown_task(rng: random.Random, index: int) -> Task:
    numbers = [rng.randint(1, 12) for _ in range(3)]
    a, b, c = numbers
    expression = rng.choice([f"{a}+{b}+{c}", f"{a}*{b}+{c}", f"{a}*{b}-{c}", f"{a}+{b}*{c}", f"({a}+{b})*{c}"])
    target = eval(expression)  # noqa: S307 (our own digits)
    shown = rng.sample(numbers, 3)
    prompt = f"Numbers: {' '.join(map(str, shown))}. Target: {target}. Use + - * and each number once.\nAnswer: "
    return Task(id=f"countdown-{index}", domain="countdown", env="answer", prompt=prompt, answer=target,
                reference_solution=expression, metadata={"checker": "countdown", "numbers": numbers, "target": target})


MAKERS = {"arithmetic": arithmetic_task, "countdown": countdown_task}


def generate_answer_tasks(num_train: int, num_heldout: int, seed: int,
                          domains: list[str] | None = None) -> tuple[list[Task], list[Task]]:
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
