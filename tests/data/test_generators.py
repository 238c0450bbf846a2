import itertools
from collections import Counter

import pytest

from tempering.data import DOMAINS, TaskSampler, generate_tasks
from tempering.data.generators import split_functions


def test_at_least_six_domains_with_examples_and_hidden_tests(tasks):
    train, heldout = tasks
    assert len(DOMAINS) >= 6
    assert set(Counter(t.domain for t in train)) == set(DOMAINS)
    for task in train[:50]:
        assert len(task.examples) == 3 and len(task.tests) == 8
        assert task.prompt.startswith("def f(") and ">>> f(" in task.prompt
        for example in task.examples:  # the examples are shown; the hidden tests are not
            assert repr(example.output) in task.prompt
        assert not {repr(t.input) for t in task.tests} & {repr(e.input) for e in task.examples}


def test_splits_are_deterministic_by_seed():
    a = generate_tasks(50, 10, seed=3)
    b = generate_tasks(50, 10, seed=3)
    c = generate_tasks(50, 10, seed=4)
    assert a == b
    assert a != c


def test_no_heldout_function_or_prompt_in_training():
    train_fns, heldout_fns = split_functions(seed=0)
    key = lambda f: (f.template.name, f.body)  # noqa: E731
    assert not {key(f) for f in train_fns} & {key(f) for f in heldout_fns}
    train, heldout = generate_tasks(3000, 300, seed=0)
    assert not {t.metadata["body"] for t in heldout} & {t.metadata["body"] for t in train}
    assert not {t.prompt for t in heldout} & {t.prompt for t in train}


def test_reference_solutions_pass_their_hidden_tests_in_the_sandbox(tasks, sandbox):
    train, heldout = tasks
    sample = train[:60] + heldout
    results = sandbox.run_tests_batch([(t, t.reference_solution) for t in sample])
    failed = [(t.id, r.status, r.tests) for t, r in zip(sample, results) if not r.all_passed]
    assert not failed
    # ... and the bare prompt (no body) passes none.
    results = sandbox.run_tests_batch([(t, t.prompt + "    return None\n") for t in sample[:20]])
    assert not any(r.all_passed for r in results)


def test_sampler_resumes_exactly(tasks):
    train, _ = tasks
    a = TaskSampler(train, seed=5)
    first = [t.id for t in a.next_batch(150)]
    state = a.state_dict()
    rest = [t.id for t in a.next_batch(120)]  # crosses an epoch boundary (200 tasks)
    b = TaskSampler(train, seed=5)
    b.load_state_dict(state)
    assert [t.id for t in b.next_batch(120)] == rest
    assert len(set(first)) == 150  # without replacement inside an epoch


def test_described_tasks_state_the_function_and_its_constants_above_the_examples():
    from tempering.data.generators import TEMPLATES

    plain, _ = generate_tasks(300, 40, seed=3)
    described, _ = generate_tasks(300, 40, seed=3, describe=True)
    assert [t.tests for t in plain] == [
        t.tests for t in described
    ]  # the same functions and tests, other text
    by_name = {t.name: t for t in TEMPLATES}
    assert all(t.describe for t in TEMPLATES)
    for task in described:
        template = by_name[task.metadata["template"]]
        names = list(template.params)
        [values] = [
            dict(zip(names, combo))
            for combo in itertools.product(*template.params.values())
            if template.body.format(**dict(zip(names, combo))) == task.metadata["body"]
        ]
        text = template.describe.format(**values)
        assert task.prompt.startswith(f'{template.signature}\n    """{text}\n\n    >>> f(')
        assert "{" not in text and all(str(v) in text for v in values.values())  # every constant is stated


def test_templates_keep_only_the_named_families_in_both_splits():
    train, heldout = generate_tasks(200, 50, seed=3, templates=["add", "reverse_list", "mul"])
    assert {t.metadata["template"] for t in train} == {"add", "reverse_list", "mul"}
    assert {t.metadata["template"] for t in heldout} == {
        "add",
        "mul",
    }  # reverse_list: one function, train only
    with pytest.raises(ValueError, match="unknown template.*'nope'"):
        generate_tasks(10, 5, templates=["add", "nope"])
    with pytest.raises(ValueError, match="no function to hold out"):
        generate_tasks(10, 5, templates=["reverse_list"])


def test_heldout_templates_hold_out_whole_families_never_trained_on():
    held = ["affine", "reverse", "sort"]
    train, heldout = generate_tasks(300, 60, seed=3, heldout_templates=held)
    assert {t.metadata["template"] for t in heldout} == set(held)
    assert not {t.metadata["template"] for t in train} & set(held)
    assert {t.metadata["template"] for t in train} >= {"add", "mul", "upper"}  # every other family, whole
    # with `templates` too, the held-out families come along (they are evaluated, not trained)
    train, heldout = generate_tasks(50, 20, seed=3, templates=["add", "mul"], heldout_templates=["sub"])
    assert {t.metadata["template"] for t in train} == {"add", "mul"}
    assert {t.metadata["template"] for t in heldout} == {"sub"}
    with pytest.raises(ValueError, match="unknown template.*'nope'"):
        generate_tasks(10, 5, heldout_templates=["nope"])


def test_heldout_templates_are_checked_when_the_config_loads():
    from tempering.config import load_config
    from tempering.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data.heldout_templates: unknown template\(s\) \['nope'\]"):
        load_config(None, ["data.heldout_templates=[nope]"])
    with pytest.raises(ConfigError, match="data.heldout_templates: applies to the built-in code generator"):
        load_config(None, ["data.heldout_templates=[add]", "data.generator=answer"])


def test_a_list_of_generators_joins_their_tasks_and_refuses_a_shared_domain():
    from tempering.config import load_config
    from tempering.errors import ConfigError
    from tempering.workspace import builtin_tasks

    pytest.importorskip("reasoning_gym")
    joint = [
        "data.generator=[reasoning_gym, code]",
        "data.gym_datasets=[gcd, basic_arithmetic]",
        "data.num_train=40",
        "data.num_heldout=12",
        "data.gym_heldout_per_domain=2",
    ]
    train, heldout = builtin_tasks(load_config(None, joint))
    assert {t.domain for t in train} == {"gcd", "basic_arithmetic", *DOMAINS}
    assert {t.env for t in train} == {"reasoning_gym", "code"}
    assert sum(t.id.startswith("reasoning_gym:gcd-") for t in heldout) == 2
    assert sum(t.id.startswith("code:heldout-") for t in heldout) == 12
    assert len({t.id for t in train + heldout}) == len(train) + len(heldout)
    # code and answer both make "arithmetic" tasks: one line naming both
    with pytest.raises(ConfigError, match="code and answer both make tasks of domain 'arithmetic'"):
        builtin_tasks(load_config(None, ["data.generator=[code, answer]", "data.num_train=20"]))
    with pytest.raises(ConfigError, match="name each generator once"):
        load_config(None, ["data.generator=[code, code]"])
    with pytest.raises(ConfigError, match="data.describe: applies to the built-in code generator"):
        load_config(None, ["data.generator=[tools, answer]", "data.describe=true"])
    load_config(None, ["data.generator=[tools, code]", "data.describe=true"])  # code is among them
