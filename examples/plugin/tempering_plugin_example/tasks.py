"""The task family: made-up words to spell backwards. `python -m tempering_plugin_example.tasks DIR` writes
DIR/train.jsonl and DIR/heldout.jsonl (the files `plugin.yaml` reads); held-out words are not in training."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ENV = "tempering_plugin_example.env:ReverseEnv"


def reverse_tasks(num_train: int, num_heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = random.Random(f"reverse:{seed}")
    words: list[str] = []
    while len(words) < num_train + num_heldout:
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 5)))
        if word not in words:
            words.append(word)
    tasks = [
        {
            "id": f"reverse-{i}",
            "domain": "reverse",
            "env": ENV,
            "prompt": f"Reverse: {w}\nAnswer: ",
            "answer": w[::-1],
            "reference_solution": w[::-1] + "\n",
        }
        for i, w in enumerate(words)
    ]
    return tasks[:num_train], tasks[num_train:]


def write(out: Path, num_train: int = 200, num_heldout: int = 24) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, tasks in zip(("train", "heldout"), reverse_tasks(num_train, num_heldout)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))


if __name__ == "__main__":
    write(Path(sys.argv[1] if len(sys.argv) > 1 else "tasks"))
