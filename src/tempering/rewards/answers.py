"""How an answer is read from a model's text: what answer environments judge (`envs.answer`) and what the
format reward of an answer task checks (`rewards.well_formed`)."""

from __future__ import annotations

import re

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_STATED = re.compile(r"\bthe (?:final )?answer is:?", re.I)


def extract_answer(action: str) -> str:
    """The answer in an action: inside the last `<answer>...</answer>`, else the last `\\boxed{...}` (MATH),
    else the text after the last `####` (GSM8K) or `Answer:`, else what follows a closing "The answer is"
    (how chat models state one: lm-eval's GSM8K chain-of-thought pattern, without its final period), else
    the whole text - stripped (answers may span lines: a matrix, a grid)."""
    tagged = _ANSWER_TAG.findall(action) or _BOXED.findall(action)
    if tagged:
        return tagged[-1].strip()
    if "####" in action:
        return action.rsplit("####", 1)[-1].strip()
    if "Answer:" in action:
        return action.rsplit("Answer:", 1)[-1].strip()
    stated = list(_STATED.finditer(action))
    return action[stated[-1].end() :].strip().removesuffix(".").strip() if stated else action.strip()


def marked_answer(action: str) -> bool:
    """Whether an action marks its answer the way `extract_answer` reads one (a tag, `\\boxed{}`, `####`,
    `Answer:`, "the answer is") - the format reward of answer tasks."""
    return bool(_ANSWER_TAG.search(action) or _BOXED.search(action) or _STATED.search(action)) or any(
        m in action for m in ("####", "Answer:")
    )
