"""Built-in Python function-synthesis tasks in six domains.

Each task shows a signature and three doctest examples; the model writes the body; eight hidden tests
(edge cases among them, tagged `edge`) decide the reward. A *function* is a template with its constants
filled in (`return x * 3 + 1`); the held-out split holds out whole functions, so no held-out function is
ever trained on, only its template's other constants. Everything is deterministic in `seed`.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tempering.types import Task, TestCase

LETTERS = "abcdefgh"

# ------------------------------------------------------------------------------------ input makers


def _int(lo: int, hi: int) -> Callable[[random.Random], tuple]:
    return lambda rng: (rng.randint(lo, hi),)


def _word(rng: random.Random, lo: int = 1, hi: int = 6) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def _ints(rng: random.Random, lo: int = 0, hi: int = 6) -> list[int]:
    return [rng.randint(-5, 15) for _ in range(rng.randint(lo, hi))]


def _dict(rng: random.Random) -> dict[str, int]:
    keys = rng.sample(LETTERS, rng.randint(1, 4))
    return {k: rng.randint(0, 9) for k in keys}


WORD = lambda rng: (_word(rng),)  # noqa: E731
INTS = lambda rng: (_ints(rng, 1),)  # noqa: E731
DICT = lambda rng: (_dict(rng),)  # noqa: E731
SMALL_N = _int(0, 12)

# Short strings a template appends, prepends or repeats: 1-2 letters from the end of the alphabet, so
# they stand out from the input words (drawn from LETTERS).
AFFIXES = ["w", "x", "y", "z"] + [a + b for a in "wxyz" for b in "wxyz" if a != b]
WORDS = ["yes", "no", "odd", "even", "big", "small", "pos", "neg", "up", "down"]


@dataclass(frozen=True)
class Template:
    name: str
    domain: str
    signature: str
    body: str
    """Body lines (indented), with `{a}`-style holes filled from `params`."""
    params: dict[str, list[Any]]
    inputs: Callable[[random.Random], tuple]
    edge: tuple[tuple, ...] = ()
    """Edge-case argument tuples, always among the hidden tests and tagged `edge`."""
    valid: Callable[..., bool] = field(default=lambda **_: True)
    probes: tuple[tuple, ...] = ()
    """Inputs shown first among the examples, chosen (as a helpful docstring would) to reveal constants."""
    describe: str = ""
    """What the function does in one sentence, with the body's holes (`data.describe` puts it in the prompt)."""

    def functions(self) -> list[tuple[str, str]]:
        """(body, description) of every function of the template."""
        names = list(self.params)
        out = []
        for combo in itertools.product(*(self.params[n] for n in names)):
            values = dict(zip(names, combo))
            if self.valid(**values):
                out.append((self.body.format(**values), self.describe.format(**values)))
        return out


R = range
INT = "def f(x: int) -> int:"
S = "def f(s: str) -> str:"
L = "def f(xs: list[int]) -> list[int]:"
LI = "def f(xs: list[int]) -> int:"
N = "def f(n: int) -> int:"

# Most templates come with probes that make every constant visible in the examples (f(0) == a for
# `x + a`), so the skill is to read the examples, not to memorise constants; constant ranges are wide
# enough that memorising is hopeless. A few templates (thresholds, modulus, slicing) need real inference.
# A table, one template per line: the formatter leaves it as written.
# fmt: off
TEMPLATES: tuple[Template, ...] = (
    # ---- integer arithmetic
    Template("add", "arithmetic", INT, "    return x + {a}", {"a": list(R(1, 41))}, _int(-5, 20), ((-1,),), probes=((0,),), describe='Return x plus {a}.'),
    Template("sub", "arithmetic", INT, "    return x - {a}", {"a": list(R(1, 41))}, _int(-5, 20), ((-1,),), probes=((0,),), describe='Return x minus {a}.'),
    Template("mul", "arithmetic", INT, "    return x * {a}", {"a": list(R(2, 25))}, _int(-5, 12), ((0,),), probes=((1,),), describe='Return x times {a}.'),
    Template("affine", "arithmetic", INT, "    return x * {a} + {b}", {"a": list(R(2, 6)), "b": list(R(1, 21))}, _int(-5, 10), ((-1,),), probes=((0,), (1,)), describe='Return x times {a}, plus {b}.'),
    Template("square_add", "arithmetic", INT, "    return x * x + {a}", {"a": list(R(1, 41))}, _int(-6, 9), ((-1,),), probes=((0,),), describe='Return x squared plus {a}.'),
    Template("rsub", "arithmetic", INT, "    return {a} - x", {"a": list(R(1, 41))}, _int(-5, 20), ((-1,),), probes=((0,),), describe='Return {a} minus x.'),
    Template("absdiff", "arithmetic", INT, "    return abs(x - {a})", {"a": list(R(1, 41))}, _int(-5, 45), ((-1,),), probes=((0,),), describe='Return the absolute difference between x and {a}.'),
    Template("mod", "arithmetic", INT, "    return x % {a}", {"a": list(R(2, 10))}, _int(0, 40), ((0,),), describe='Return the remainder of x divided by {a}.'),
    # ---- string transforms
    Template("suffix", "strings", S, '    return s + "{c}"', {"c": AFFIXES}, WORD, (("",),), describe='Return s with "{c}" added at the end.'),
    Template("prefix", "strings", S, '    return "{c}" + s', {"c": AFFIXES}, WORD, (("",),), describe='Return s with "{c}" added at the front.'),
    Template("rev_suffix", "strings", S, '    return s[::-1] + "{c}"', {"c": AFFIXES}, WORD, (("",),), describe='Return s reversed, with "{c}" added at the end.'),
    Template("upper_suffix", "strings", S, '    return s.upper() + "{c}"', {"c": AFFIXES}, WORD, (("",),), describe='Return s in upper case, with "{c}" added at the end.'),
    Template("wrap", "strings", S, '    return "{c}" + s + "{d}"', {"c": AFFIXES[:4], "d": AFFIXES[:4]}, WORD, (("",),), lambda c, d: c != d, describe='Return s with "{c}" added at the front and "{d}" at the end.'),
    Template("replace", "strings", S, '    return s.replace("{c}", "{d}")', {"c": list(LETTERS[:4]), "d": list("wxyz")}, lambda rng: (_word(rng, 3, 6),), (("",),), describe='Return s with every "{c}" replaced by "{d}".'),
    Template("reverse", "strings", S, "    return s[::-1]", {}, WORD, (("",),), describe='Return s reversed.'),
    Template("upper", "strings", S, "    return s.upper()", {}, WORD, (("",),), describe='Return s in upper case.'),
    Template("repeat", "strings", S, "    return s * {a}", {"a": [2, 3]}, WORD, (("",),), describe='Return s repeated {a} times.'),
    Template("head", "strings", S, "    return s[:{a}]", {"a": list(R(1, 5))}, WORD, (("",),), describe='Return the first {a} characters of s.'),
    # ---- list operations
    Template("map_add", "lists", L, "    return [v + {a} for v in xs]", {"a": list(R(1, 31))}, INTS, (([],),), probes=(([0],),), describe='Return a list with {a} added to each value of xs.'),
    Template("map_mul", "lists", L, "    return [v * {a} for v in xs]", {"a": list(R(2, 16))}, INTS, (([],),), probes=(([1],),), describe='Return a list with each value of xs multiplied by {a}.'),
    Template("append", "lists", L, "    return xs + [{a}]", {"a": list(R(0, 41))}, INTS, (([],),), describe='Return xs with {a} appended at the end.'),
    Template("push_front", "lists", L, "    return [{a}] + xs", {"a": list(R(0, 41))}, INTS, (([],),), describe='Return xs with {a} inserted at the front.'),
    Template("sum_add", "lists", LI, "    return sum(xs) + {a}", {"a": list(R(1, 41))}, INTS, (([],),), probes=(([0],),), describe='Return the sum of xs plus {a}.'),
    Template("max_mul", "lists", LI, "    return max(xs) * {a}", {"a": list(R(2, 16))}, INTS, probes=(([1],),), describe='Return the largest value of xs times {a}.'),
    Template("filter_gt", "lists", L, "    return [v for v in xs if v > {a}]", {"a": list(R(0, 12))}, INTS, (([],),), describe='Return the values of xs that are greater than {a}, in order.'),
    Template("sort", "lists", L, "    return sorted(xs)", {}, INTS, (([],),), describe='Return xs sorted in increasing order.'),
    Template("reverse_list", "lists", L, "    return xs[::-1]", {}, INTS, (([],),), describe='Return xs in reverse order.'),
    # ---- conditionals / branching
    Template("clamp_low", "conditionals", INT, "    return max(x, {a})", {"a": list(R(0, 31))}, _int(-5, 40), ((0,),), probes=((-5,),), describe='Return x, but at least {a}.'),
    Template("clamp_high", "conditionals", INT, "    return min(x, {a})", {"a": list(R(0, 31))}, _int(-5, 40), ((0,),), probes=((99,),), describe='Return x, but at most {a}.'),
    Template("parity", "conditionals", INT, "    return {a} if x % 2 == 0 else {b}", {"a": list(R(0, 16)), "b": list(R(0, 16))}, _int(-5, 20), ((-1,),), lambda a, b: a != b, probes=((0,), (1,)), describe='Return {a} if x is even, else {b}.'),
    Template("sign_word", "conditionals", "def f(x: int) -> str:", '    return "{w}" if x > 0 else "{v}"', {"w": WORDS, "v": WORDS}, _int(-9, 9), ((0,),), lambda w, v: w != v, probes=((1,), (-1,)), describe='Return "{w}" if x is positive, else "{v}".'),
    Template("step", "conditionals", INT, "    return {a} if x > {b} else {c}", {"a": list(R(1, 10)), "b": list(R(0, 10, 2)), "c": list(R(0, 10))}, _int(-5, 15), ((0,),), lambda a, b, c: a != c, describe='Return {a} if x is greater than {b}, else {c}.'),
    Template("label", "conditionals", "def f(x: int) -> str:", '    return "big" if x > {a} else "small"', {"a": list(R(0, 15))}, _int(-5, 20), ((0,),), describe='Return "big" if x is greater than {a}, else "small".'),
    # ---- loops / accumulation
    Template("sum_range", "loops", N, "    total = 0\n    for i in range(n):\n        total += i + {a}\n    return total", {"a": list(R(1, 31))}, SMALL_N, ((0,),), probes=((1,),), describe='Return the sum of i + {a} for i from 0 to n - 1.'),
    Template("sum_mul", "loops", N, "    total = 0\n    for i in range(n):\n        total += i * {a}\n    return total", {"a": list(R(2, 21))}, SMALL_N, ((0,),), probes=((2,),), describe='Return the sum of i * {a} for i from 0 to n - 1.'),
    Template("power", "loops", N, "    total = {a}\n    for i in range(n):\n        total *= {b}\n    return total", {"a": list(R(1, 21)), "b": [2, 3]}, SMALL_N, ((0,),), probes=((0,), (1,)), describe='Return {a} times {b} to the power n.'),
    Template("build", "loops", "def f(n: int) -> list[int]:", "    out = []\n    for i in range(n):\n        out.append(i * {a})\n    return out", {"a": list(R(1, 21))}, SMALL_N, ((0,),), probes=((2,),), describe='Return the list [i * {a} for i from 0 to n - 1].'),
    Template("repeat_char", "loops", "def f(n: int) -> str:", '    out = ""\n    for i in range(n):\n        out += "{c}"\n    return out', {"c": AFFIXES}, SMALL_N, ((0,),), probes=((1,),), describe='Return "{c}" repeated n times.'),
    Template("weighted_sum", "loops", LI, "    total = 0\n    for v in xs:\n        total += v * {a}\n    return total", {"a": list(R(2, 21))}, INTS, (([],),), probes=(([1],),), describe='Return the sum of the values of xs, each multiplied by {a}.'),
    Template("count_mult", "loops", N, "    count = 0\n    for i in range(n):\n        if i % {a} == 0:\n            count += 1\n    return count", {"a": list(R(2, 7))}, _int(0, 20), ((0,),), describe='Return how many i from 0 to n - 1 are divisible by {a}.'),
    # ---- dictionaries / counting
    Template("scale_values", "counting", "def f(d: dict[str, int]) -> dict[str, int]:", "    return {{k: v * {a} for k, v in d.items()}}", {"a": list(R(2, 21))}, DICT, (({},),), probes=(({"a": 1},),), describe='Return a dict with the same keys as d and each value multiplied by {a}.'),
    Template("add_values", "counting", "def f(d: dict[str, int]) -> dict[str, int]:", "    return {{k: v + {a} for k, v in d.items()}}", {"a": list(R(1, 31))}, DICT, (({},),), probes=(({"a": 0},),), describe='Return a dict with the same keys as d and {a} added to each value.'),
    Template("get_default", "counting", "def f(d: dict[str, int]) -> int:", '    return d.get("a", {a})', {"a": list(R(10, 41))}, DICT, (({"a": 0},),), probes=(({},),), describe='Return d["a"] if d has the key "a", else {a}.'),
    Template("count_char", "counting", "def f(s: str) -> int:", '    return s.count("{c}")', {"c": list(LETTERS)}, WORD, (("",),), describe='Return how many times "{c}" occurs in s.'),
    Template("count_value", "counting", LI, "    return xs.count({a})", {"a": list(R(0, 10))}, lambda rng: ([rng.randint(0, 9) for _ in range(rng.randint(1, 8))],), (([],),), describe='Return how many times {a} occurs in xs.'),
    Template("distinct", "counting", LI, "    return len(set(xs))", {}, INTS, (([],),), describe='Return the number of distinct values in xs.'),
    Template("histogram", "counting", "def f(s: str) -> dict[str, int]:", "    return {{c: s.count(c) for c in s}}", {}, WORD, (("",),), describe='Return a dict mapping each character of s to the number of times it occurs in s.'),
)
# fmt: on

DOMAINS: tuple[str, ...] = tuple(dict.fromkeys(t.domain for t in TEMPLATES))
N_EXAMPLES = 3
N_HIDDEN = 8


@dataclass(frozen=True)
class Function:
    template: Template
    body: str
    description: str = ""

    @property
    def source(self) -> str:
        return f"{self.template.signature}\n{self.body}\n"


@functools.lru_cache(maxsize=4096)
def _compile(source: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    exec(compile(source, "<reference>", "exec"), namespace)  # our own reference code, not a model's
    return namespace["f"]


def _prompt(fn: Function, examples: list[tuple[tuple, Any]], describe: bool) -> str:
    lines = (
        [fn.template.signature, f'    """{fn.description}', ""]
        if describe
        else [fn.template.signature, '    """']
    )
    for args, out in examples:
        lines.append(f"    >>> f({', '.join(map(repr, args))})")
        lines.append(f"    {out!r}")
    lines.append('    """')
    return "\n".join(lines) + "\n"


EXAMPLE_CHARS = 40
"""Examples shown in the prompt are kept short (rendered call + output): prompt length is training cost."""


def _draw_inputs(
    fn: Function, rng: random.Random, call: Callable[..., Any]
) -> list[tuple[tuple, Any]] | None:
    """N_EXAMPLES short examples, then N_HIDDEN hidden cases (edge cases first), all distinct inputs."""
    seen: set[str] = set()
    cases: list[tuple[tuple, Any]] = []
    edges = list(fn.template.edge)
    probes = list(fn.template.probes)
    for attempt in range(400):
        if len(cases) == N_EXAMPLES + N_HIDDEN:
            break
        is_example = len(cases) < N_EXAMPLES
        # Examples: the probes, then ordinary inputs; edge cases go to the hidden tests only.
        if is_example and probes:
            args = probes.pop(0)
        elif not is_example and edges:
            args = edges.pop(0)
        else:
            args = fn.template.inputs(rng)
        key = repr(args)
        if key in seen:
            continue
        try:
            out = call(*args)
        except Exception:  # e.g. max([]) - such inputs are simply not used
            continue
        if is_example and attempt < 300 and len(key) + len(repr(out)) > EXAMPLE_CHARS:
            continue
        seen.add(key)
        cases.append((args, out))
    return cases if len(cases) == N_EXAMPLES + N_HIDDEN else None


def make_task(fn: Function, rng: random.Random, task_id: str, describe: bool = False) -> Task | None:
    call = _compile(fn.source)
    cases = _draw_inputs(fn, rng, call)
    if cases is None:
        return None
    examples, hidden = cases[:N_EXAMPLES], cases[N_EXAMPLES:]
    edge_keys = {repr(e) for e in fn.template.edge}

    def case(i: int, args: tuple, out: Any) -> TestCase:
        tags = ["edge"] if repr(args) in edge_keys else []
        return TestCase(name=f"test_{i}", input=list(args), output=out, tags=tags)

    return Task(
        id=task_id,
        domain=fn.template.domain,
        prompt=_prompt(fn, examples, describe),
        entry_point="f",
        tests=[case(i, a, o) for i, (a, o) in enumerate(hidden)],
        examples=[case(i, a, o) for i, (a, o) in enumerate(examples)],
        reference_solution=fn.source,
        metadata={"template": fn.template.name, "body": fn.body},
    )


def split_functions(
    seed: int,
    domains: list[str] | None = None,
    heldout_fraction: float = 0.25,
    templates: list[str] | None = None,
    heldout_templates: list[str] | None = None,
) -> tuple[list[Function], list[Function]]:
    """Every function of every template (of `domains`, of `templates`), split into (train, held-out) by seed.

    Templates with fewer than 5 functions are train-only: holding one out would test a template the model
    has never seen rather than a new instance of a known one. With `heldout_templates` the split is by
    family instead: their functions are all held out, every other template's all trained on.
    """
    rng = random.Random(f"split:{seed}")
    train, heldout = [], []
    for template in TEMPLATES:
        if domains is not None and template.domain not in domains:
            continue
        if templates is not None and template.name not in templates:
            continue
        fns = [Function(template, body, text) for body, text in template.functions()]
        if heldout_templates is not None:
            (heldout if template.name in heldout_templates else train).extend(fns)
            continue
        rng.shuffle(fns)
        n_hold = int(len(fns) * heldout_fraction) if len(fns) >= 5 else 0
        heldout += fns[:n_hold]
        train += fns[n_hold:]
    return train, heldout


def _tasks(
    fns: list[Function],
    n: int,
    seed: str,
    prefix: str,
    exclude: frozenset[str] = frozenset(),
    describe: bool = False,
) -> Iterator[Task]:
    """n tasks, domains in turn, then a random template, then a random function (big templates don't dominate)."""
    rng = random.Random(seed)
    by_domain: dict[str, dict[str, list[Function]]] = {}
    for fn in fns:
        by_domain.setdefault(fn.template.domain, {}).setdefault(fn.template.name, []).append(fn)
    domains = sorted(by_domain)
    made = 0
    while made < n:
        templates = by_domain[domains[made % len(domains)]]
        fn = rng.choice(templates[rng.choice(sorted(templates))])
        task = make_task(fn, rng, f"{prefix}-{made:06d}", describe)
        if task is not None and task.prompt not in exclude:
            made += 1
            yield task


def generate_tasks(
    num_train: int,
    num_heldout: int,
    seed: int = 0,
    domains: list[str] | None = None,
    *,
    templates: list[str] | None = None,
    heldout_templates: list[str] | None = None,
    describe: bool = False,
) -> tuple[list[Task], list[Task]]:
    """(train, held-out) task lists; no held-out function appears among the training tasks. `templates`
    keeps only the named templates; `describe` states in the docstring what the function does ("Return x
    plus 7."), above the examples - a task an instruction-tuned model can read, not only infer.
    `heldout_templates`: hold out these whole families (`split_functions`)."""
    unknown = set(domains or ()) - set(DOMAINS)
    if unknown:
        raise ValueError(f"unknown domain(s) {sorted(unknown)}; valid: {', '.join(DOMAINS)}")
    unknown = (set(templates or ()) | set(heldout_templates or ())) - {t.name for t in TEMPLATES}
    if unknown:
        raise ValueError(
            f"unknown template(s) {sorted(unknown)}; valid: {', '.join(t.name for t in TEMPLATES)}"
        )
    if heldout_templates is not None and templates is not None:
        templates = sorted(set(templates) | set(heldout_templates))
    train_fns, heldout_fns = split_functions(
        seed, domains, templates=templates, heldout_templates=heldout_templates
    )
    if not train_fns or not heldout_fns:
        raise ValueError(
            "data.domains and data.templates leave no function to "
            + ("train on" if not train_fns else "hold out (a template needs 5+ functions)")
        )
    train = list(_tasks(train_fns, num_train, f"train:{seed}", "train", describe=describe))
    # Two functions can agree on the three examples; a held-out prompt identical to a training prompt is
    # skipped, so no held-out task is seen in training even as text.
    seen = frozenset(t.prompt for t in train)
    heldout = list(_tasks(heldout_fns, num_heldout, f"heldout:{seed}", "heldout", seen, describe))
    return train, heldout
