"""reasoning-gym's verifiers, as run inside a sandbox worker (see `tempering.envs.gym`).

Several verifiers evaluate the model's answer as Python (`eval`, sympy's `parse_expr`), so they never run
in the trainer: this module is imported once by each worker of the verifier pool, before the worker
forks, and each answer is then scored in a forked, limited execution of its own (`score`). It imports
nothing from tempering: the worker sees /usr and the read-only import paths it was given.

Importing it loads reasoning-gym, creates every dataset once with its default configuration (some read
data files when created: arc_agi ~1 s) and runs sympy's parser once, so that a forked execution finds all
of it built. A task generated with other options gets its dataset created in its own execution.

The sandbox keeps a crafted answer away from the host; `guard` keeps it from forging its own score inside
the sandbox. While a verifier runs, every string it hands to `eval`/`compile` must be an expression of
literals, operators, calls of sympy's expression classes (and sqrt/root) and plain names: no attribute
access, no name starting with `_`, no other builtin or sympy function (open, getattr, preview, ...), no
statement. Anything else is refused before it compiles, so the verifier sees an error and scores 0.
"""

import ast
import builtins
import io
import json
import keyword
import sys
import tokenize

import reasoning_gym
import sympy
from reasoning_gym.dataset import ProceduralDataset
from sympy.parsing.sympy_parser import parse_expr

EXCLUDED = {"composite"}  # a mixer, not a task family (as in tempering.envs.gym)
SAFE_BUILTINS = {"abs", "min", "max", "round", "int", "float", "complex", "pow", "len", "sum"}
SAFE_KEYWORDS = {"True", "False", "None", "and", "or", "not", "in", "is", "if", "else", "for"}
SYMPY_HELPERS = {"sqrt", "cbrt", "root", "real_root"}  # plain functions that build expressions
TRUSTED_SOURCES = {"from sympy import *"}  # what parse_expr compiles on every call to build its namespace


def _create(name, config):
    return reasoning_gym.create_dataset(name, seed=0, size=1, **config)


def _warm():
    built = {}
    for name in sorted(set(reasoning_gym.factory.DATASETS) - EXCLUDED):
        try:
            built[name] = _create(name, {})
        except Exception:  # noqa: BLE001 - built on demand instead, where the error is reported
            pass
    parse_expr("sqrt(x) + sin(x)**2 / 3")  # sympy's lazy imports happen here, before any fork
    return built


def _denied_names():
    namespace = {}
    exec("from sympy import *", namespace)  # the names parse_expr's code is evaluated with
    expressions = {
        name
        for name, obj in namespace.items()
        if isinstance(obj, sympy.Basic) or (isinstance(obj, type) and issubclass(obj, sympy.Basic))
    }
    return frozenset(
        (set(namespace) - expressions - SYMPY_HELPERS)
        | (set(vars(builtins)) - SAFE_BUILTINS)
        | (set(keyword.kwlist) - SAFE_KEYWORDS)
    )


DEFAULT_DATASETS = _warm()
DENIED_NAMES = _denied_names()
_guarding = False


def why_refused(source):
    """None if `source` may be compiled while a verifier runs, else why not."""
    if isinstance(source, ast.AST):
        source = ast.unparse(source)
    if isinstance(source, (bytes, bytearray)):
        source = bytes(source).decode("utf-8", "replace")
    if not isinstance(source, str):
        return "not source text"
    if source.strip() in TRUSTED_SOURCES:
        return None
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return "does not tokenize"
    for tok, following in zip(tokens, tokens[1:] + tokens[-1:]):
        if tok.type == tokenize.OP and tok.string == ".":
            return "attribute access"
        if tok.type != tokenize.NAME:
            continue
        if tok.string.startswith("_"):
            return f"name {tok.string}"
        keyword_argument = following.type == tokenize.OP and following.string == "="
        if tok.string in DENIED_NAMES and not keyword_argument:
            return f"name {tok.string}"
    return None


def guard(event, args):
    """Audit hook: refuse to compile source that is not a plain expression while a verifier runs."""
    if _guarding and event == "compile" and len(args) > 1 and args[1] == "<string>":
        why = why_refused(args[0])
        if why is not None:
            raise RuntimeError(f"refused to evaluate model text ({why})")


def restore(entry):
    """Undo what a JSON round trip changed in an entry: arc_agi/rearc compare tuples, JSON has lists."""
    meta = entry.get("metadata", {})
    if isinstance(meta.get("output"), list) and meta.get("source_dataset") in ("arc_agi", "rearc"):
        entry = {**entry, "metadata": {**meta, "output": tuple(map(tuple, meta["output"]))}}
    return entry


def score(name, config_json, entry, answer):
    """The dataset's verifier on `answer`, as a float (the host clips it to [0, 1])."""
    global _guarding
    config = json.loads(config_json)
    dataset = DEFAULT_DATASETS.get(name) if not config else None
    if dataset is None:
        dataset = _create(name, config)
    entry = restore(entry)
    if type(dataset).score_answer is ProceduralDataset.score_answer:
        # The base scorer gives len(oracle) / len(answer) to any answer that contains the oracle: "21" earns
        # 0.5 on every GCD of 1 or 2. An answer listing candidates is not partly right: exact match only.
        return float(isinstance(answer, str) and answer == entry["answer"])
    sys.addaudithook(guard)  # in this forked execution only; an audit hook cannot be removed
    _guarding = True
    value = dataset.score_answer(answer, entry)
    _guarding = False
    return float(value or 0.0)
