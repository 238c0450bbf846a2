"""The SmolLM2 recipe's RL step against TRL's GRPOTrainer on the same work, both in bf16, per phase.

    .venv/bin/python bench/trl_compare.py [--steps 4] [--rounds 2] [--trl .venv-trl/bin/python]
        [--record results/trl-step.json]

The work is `configs/smollm2-functions.yaml` (`make smollm2`): SmolLM2-135M-Instruct, 8 prompts x 8 samples,
160 new tokens at T=0.8, full fine-tuning at lr 1e-5, two minibatches (optimizer steps) per RL step, no KL
term, bf16 matmuls over fp32 weights. tempering runs it with `tempering train` (every row trained:
`algo.skip_zero_advantage=false`, as TRL does); the prompts of each of its steps, in order and rendered by
the chat template as its engine sampled them, are TRL's dataset (`shuffle_dataset=False`), with the same
reward (the fraction of tests passed, in tempering's sandbox). TRL samples with `model.generate`, as its
trainer does without a vLLM server. Rounds alternate the arms, so the machine's drift hits both alike.

Printed: mean seconds per RL step over steps 2..N, per phase - collect (sampling and scoring: TRL's
`_generate_and_score_completions`, which also computes the old log-probs), update (the optimizer steps) and
the step - with tempering / TRL, the completion tokens per row (equal work), and the update's trained
tokens/s beside the matmul ceiling of the same update measured in the same run (`bench/ceiling.py`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from ceiling import update_ceiling  # bench/, beside this script
from phase_times import COMMON, ROOT, tempering
from record import write_record

from tempering.checkpoint import resolve_model
from tempering.config import load_config
from tempering.data import load_tasks
from tempering.inference.chat import chat_format
from tempering.models.loading import load_model, load_tokenizer

RECIPE = "configs/smollm2-functions.yaml"
SETTINGS = ["data.num_heldout=4", "eval.benchmarks=[]", "algo.skip_zero_advantage=false"]


def tempering_arm(run_dir: Path, steps: int) -> dict[str, list[float]]:
    """Run the recipe for `steps` steps; its phases' seconds per step (step 1 left out)."""
    tempering(
        ROOT, "train", RECIPE, f"run.dir={run_dir}", f"train.steps={steps}", *COMMON, *SETTINGS,
        "tracking.samples_every=1",
    )  # fmt: skip
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    per = defaultdict(list)
    for row in rows:
        per["collect"].append(row.get("timing_s/gen", 0.0) + row.get("timing_s/reward", 0.0))
        per["update"].append(row.get("timing_s/update", 0.0))
        per["step"].append(row["timing_s/step"])
        per["tokens"].append(row["response_length/mean"])
    return per


def trl_job(cfg, run_dir: Path, model_dir: Path, out_dir: Path) -> dict:
    """TRL's job: the recipe's (`cfg`) settings and tempering's prompts of each step, in order, with their
    tasks."""
    tasks = {t.id: t for t in load_tasks(run_dir / "data" / "train.jsonl")}
    tokenizer = load_tokenizer(model_dir)
    fmt = chat_format(tokenizer, "auto")
    instruction = cfg.env.options.code_instruction
    steps = []
    for path in sorted((run_dir / "samples").glob("step_*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        ids = list(dict.fromkeys(r["task_id"] for r in rows))  # one per group, in order
        texts = [f"{instruction}\n\n{tasks[i].prompt}" if instruction else tasks[i].prompt for i in ids]
        prompts = [tokenizer.decode(fmt.start(t)[0]) for t in texts]
        steps.append({"prompts": prompts, "tasks": [tasks[i].model_dump(mode="json") for i in ids]})
    rollout, algo = cfg.rollout, cfg.algo
    return {
        "model_dir": str(model_dir),
        "out_dir": str(out_dir),
        "threads": cfg.run.threads,
        "steps": steps,
        "group_size": rollout.group_size,
        "prompts_per_step": rollout.prompts_per_step,
        "max_new_tokens": rollout.max_new_tokens,
        "temperature": rollout.temperature,
        "lr": algo.lr,
        "minibatches": algo.minibatches,
        "kl_coef": algo.kl_coef,
    }


def trl_arm(python: str, job: dict, work: Path) -> tuple[dict[str, list[float]], str]:
    job_path, out_path = work / "trl-job.json", work / "trl-out.json"
    job_path.write_text(json.dumps(job))
    subprocess.run([python, str(ROOT / "bench" / "trl_worker.py"), str(job_path), str(out_path)], check=True)
    result = json.loads(out_path.read_text())
    per = defaultdict(list)
    for row in result["steps"][1:]:
        for key in ("collect", "update", "step", "tokens"):
            per[key].append(row[key])
    return per, result["trl"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trl", default=".venv-trl/bin/python", help="python of the TRL venv (`make trl`)")
    parser.add_argument("--record", metavar="PATH", help="also write the step ratio as a result record")
    args = parser.parse_args()
    cfg = load_config(ROOT / RECIPE)
    model_dir = resolve_model(cfg.model.name)
    work = Path(tempfile.mkdtemp(prefix="trl-compare-"))
    runs: dict[str, dict[str, list[float]]] = {"tempering": defaultdict(list), "TRL": defaultdict(list)}
    version = "?"
    for r in range(args.rounds):
        run_dir = work / f"tempering-{r}"
        for key, values in tempering_arm(run_dir, args.steps).items():
            runs["tempering"][key] += values
        per, version = trl_arm(args.trl, trl_job(cfg, run_dir, model_dir, work / f"trl-{r}"), work)
        for key, values in per.items():
            runs["TRL"][key] += values
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size  # a step's rows
    tokens = statistics.mean(runs["tempering"]["tokens"]) * rows
    ceiling = update_ceiling(load_model(model_dir), int(tokens), torch.bfloat16)
    print(
        f"\n{RECIPE}: s per RL step, mean of steps 2-{args.steps} over {args.rounds} alternating rounds; "
        f"bf16 both (TRL {version}, autocast; tempering model.compute bfloat16)"
    )
    print(f"{'phase':<10} {'tempering':>10} {'TRL':>10} {'ratio':>8}")
    means = {arm: {k: statistics.mean(v) for k, v in per.items()} for arm, per in runs.items()}
    for key in ("collect", "update", "step", "tokens"):
        t, p = means["tempering"][key], means["TRL"][key]
        print(f"{key:<10} {t:>10.2f} {p:>10.2f} {t / p:>7.2f}x")
    for arm in runs:
        trained = means[arm]["tokens"] * rows / means[arm]["update"]
        print(
            f"{arm}: update {trained:.0f} trained tokens/s, {trained / ceiling['tokens_per_s']:.0%} of the "
            f"matmul ceiling ({ceiling['tokens_per_s']:.0f} tokens/s at {int(tokens)} tokens, bf16)"
        )
    ratio = means["tempering"]["step"] / means["TRL"]["step"]
    if args.record:
        write_record(
            args.record,
            name="trl-step",
            figure=f"SmolLM2 RL step: {ratio:.2f}x TRL GRPOTrainer's, bf16 both",
            unit="x",
            value=round(ratio, 3),
            values={f"{arm} {k}": round(v, 3) for arm, m in means.items() for k, v in m.items()},
            notes=f"{RECIPE}, steps 2-{args.steps}, {args.rounds} alternating rounds; TRL {version}.",
        )


if __name__ == "__main__":
    main()
