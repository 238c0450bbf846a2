"""TRL's arm of `bench/trl_compare.py`, run with the TRL venv's python (`make trl`): GRPOTrainer on the jobs
the driver wrote (the same prompts, in the same order, as tempering's run), timing each RL step's phases.

    .venv-trl/bin/python bench/trl_worker.py JOB.json OUT.json

JOB: model directory, the recipe's settings, and per RL step the prompts (the chat-templated text tempering's
engine sampled from) with their tasks. Rewards: the fraction of the task's tests passed, run in tempering's
sandbox (the recipe's `tests` reward). OUT: per RL step, seconds of generation and scoring
(`_generate_and_score_completions`, which also computes the old log-probs) and of the update (the optimizer
steps on that generation), and the completion tokens.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from tempering.envs.code import program_of
from tempering.sandbox import LocalSandbox
from tempering.types import Task

ACCUMULATE = 2
"""Micro-batches per optimizer step."""


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(job["threads"])
    tasks = {t["id"]: Task.model_validate(t) for step in job["steps"] for t in step["tasks"]}
    rows = [
        {"prompt": prompt, "task_id": task["id"]}
        for step in job["steps"]
        for prompt, task in zip(step["prompts"], step["tasks"])
    ]
    sandbox = LocalSandbox(workers=job["threads"])
    reward_s: list[float] = []

    def tests_passed(prompts, completions, task_id, **_) -> list[float]:
        started = time.perf_counter()
        batch = [(tasks[i], program_of(tasks[i], c)) for i, c in zip(task_id, completions)]
        results = sandbox.run_tests_batch(batch)
        reward_s.append(time.perf_counter() - started)
        return [sum(t.passed for t in r.tests) / max(1, len(r.tests)) for r in results]

    group, prompts_per_step, minibatches = job["group_size"], job["prompts_per_step"], job["minibatches"]
    rows_per_step = group * prompts_per_step
    config = GRPOConfig(
        output_dir=job["out_dir"],
        use_cpu=True,
        bf16=True,  # autocast bf16 over fp32 weights, as tempering's `model.compute: bfloat16`
        learning_rate=job["lr"],
        num_generations=group,
        # One generation of rows_per_step rows, `minibatches` optimizer steps on it, each over 1/minibatches of its
        # rows in two micro-batches: the same optimizer steps, in half the activation memory (one micro-batch
        # of 32 rows without checkpointing was killed for memory at 19 GB on a 24 GB machine).
        per_device_train_batch_size=rows_per_step // minibatches // ACCUMULATE,
        gradient_accumulation_steps=ACCUMULATE,
        steps_per_generation=minibatches * ACCUMULATE,
        num_iterations=1,
        max_completion_length=job["max_new_tokens"],
        temperature=job["temperature"],
        top_p=1.0,
        top_k=0,
        beta=job["kl_coef"],
        gradient_checkpointing=False,  # the recipe keeps activations (TRL defaults to True)
        max_steps=len(job["steps"]) * minibatches,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    tokenizer.padding_side = "left"
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[tests_passed],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    generation: list[tuple[float, int]] = []
    original = trainer._generate_and_score_completions

    def timed(inputs):
        started = time.perf_counter()
        out = original(inputs)
        generation.append((time.perf_counter() - started, int(out["completion_mask"].sum())))
        return out

    trainer._generate_and_score_completions = timed
    steps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            steps.append(time.perf_counter() - self.began)

    trainer.add_callback(Clock())
    trainer.train()
    sandbox.close()
    out = []
    for i, (gen_s, tokens) in enumerate(generation):
        optimizer_steps = steps[i * minibatches : (i + 1) * minibatches]
        step_s = sum(optimizer_steps)
        out.append(
            {
                "step": step_s,
                "collect": gen_s,
                "reward": reward_s[i] if i < len(reward_s) else 0.0,
                "update": step_s - gen_s,
                "tokens": tokens / rows_per_step,
            }
        )
    with open(sys.argv[2], "w") as f:
        json.dump({"steps": out, "trl": __import__("trl").__version__}, f)


if __name__ == "__main__":
    main()
