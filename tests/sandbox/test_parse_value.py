"""`parse_value` reads a program's returned repr in the trainer process: plain literals only, bounded."""

import pytest

from tempering.sandbox import parse_value
from tempering.sandbox.grading import MAX_VALUE_CHARS


def test_plain_literals_and_special_floats_are_read():
    assert parse_value("[1, (2, 'a'), {'k': None}]") == [1, (2, "a"), {"k": None}]
    assert parse_value("-inf") == float("-inf")
    deep = "[" * 150 + "]" * 150
    assert parse_value(deep) is not None


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",  # code is never run
        "[" * 100_000 + "]" * 100_000,  # nesting past the tokenizer's limit
        "-" * 1_000_000 + "1",  # past the parser's stack
        "1" + "+1" * 1_000_000,  # not a literal
        "[" + "1," * (MAX_VALUE_CHARS // 2) + "]",  # longer than a worker can return
    ],
)
def test_hostile_returned_text_is_a_value_error(text):
    with pytest.raises(ValueError):
        parse_value(text)
