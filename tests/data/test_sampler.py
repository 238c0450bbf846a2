"""The domain-mixture sampler: weights, and a resumed sampler continues the same domain sequence."""

from collections import Counter

import pytest

from tempering.data import MixtureSampler
from tempering.envs.answer import generate_answer_tasks


@pytest.fixture(scope="module")
def answer_tasks():
    train, _ = generate_answer_tasks(200, 0, seed=0)
    return train


def test_domains_are_drawn_by_weight(answer_tasks):
    sampler = MixtureSampler(answer_tasks, {"arithmetic": 3.0, "countdown": 1.0}, seed=0)
    counts = Counter(t.domain for t in sampler.next_batch(4000))
    assert 0.70 < counts["arithmetic"] / 4000 < 0.80


def test_star_weights_unlisted_domains_and_zero_excludes(answer_tasks):
    only = MixtureSampler(answer_tasks, {"countdown": 1.0}, seed=0)
    assert {t.domain for t in only.next_batch(50)} == {"countdown"}
    star = MixtureSampler(answer_tasks, {"*": 1.0, "countdown": 0.0}, seed=0)
    assert {t.domain for t in star.next_batch(50)} == {"arithmetic"}
    with pytest.raises(ValueError, match="without tasks: \\['nope'\\]"):
        MixtureSampler(answer_tasks, {"nope": 1.0}, seed=0)


def test_a_resumed_sampler_continues_the_same_domain_sequence(answer_tasks):
    weights = {"arithmetic": 1.0, "countdown": 2.0}
    straight = MixtureSampler(answer_tasks, weights, seed=4)
    expected = [t.id for _ in range(30) for t in straight.next_batch(7)]
    first = MixtureSampler(answer_tasks, weights, seed=4)
    got = [t.id for _ in range(11) for t in first.next_batch(7)]
    resumed = MixtureSampler(answer_tasks, weights, seed=4)
    resumed.load_state_dict(first.state_dict())
    got += [t.id for _ in range(19) for t in resumed.next_batch(7)]
    assert got == expected
    other_seed = MixtureSampler(answer_tasks, weights, seed=5)
    assert [t.id for t in other_seed.next_batch(30)] != expected[:30]


def test_a_state_for_other_domains_is_refused(answer_tasks):
    a = MixtureSampler(answer_tasks, {"arithmetic": 1.0}, seed=0)
    b = MixtureSampler(answer_tasks, {"*": 1.0}, seed=0)
    with pytest.raises(ValueError, match="domains"):
        b.load_state_dict(a.state_dict())
