"""End-to-end runs through the environments: tool use, and a 100+-domain reasoning-gym mix that resumes."""

import json

import pytest

from tests.helpers.runs import kill_after_checkpoint, metrics, stable, tempering

GYM = [
    "data.generator=reasoning_gym",
    "data.num_train=105",
    "data.gym_heldout_per_domain=1",
    "data.mixture={'*': 1.0, basic_arithmetic: 5.0}",
    "model.max_length=1024",
    "env.max_context=1024",
    "rollout.prompts_per_step=6",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "eval.val_tasks=128",
    "eval.samples=1",
    "sft.steps=4",
]


@pytest.mark.slow
def test_a_tool_use_run_trains_on_episodes(tmp_path):
    run_dir = tmp_path / "tools"
    tempering(
        "train",
        "configs/smoke.yaml",
        f"run.dir={run_dir}",
        "data.generator=tools",
        "env.max_turns=3",
        "env.max_context=192",
        "sft.steps=30",
        "train.steps=3",
        "eval.every=0",
    )
    rows = metrics(run_dir)
    assert len(rows) == 3
    for key in (
        "num_turns/mean",
        "train/pass_rate",
        "reward/success/mean",
        "reward/tool_error/mean",
        "reward/tool_calc/mean",
        "actor/pg_loss",
    ):
        assert any(key in r for r in rows), key
    samples = [
        json.loads(line) for line in (run_dir / "samples" / "step_000001.jsonl").read_text().splitlines()
    ]
    assert all(s["turns"] and s["domain"].startswith("tool_") for s in samples)
    assert any(
        t["observation"] and t["observation"].startswith("<tool_response>")
        for s in samples
        for t in s["turns"]
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "heldout_first_turn_pass@1_after" in summary
    # Each later turn computed only its new tokens (the last action token and the tool's answer).
    later = [r for r in rows if "rollout/prefill_tokens_per_turn" in r]
    assert later and all(
        r["rollout/prefill_tokens_per_turn"] == r["rollout/new_tokens_per_turn"] for r in later
    )


@pytest.fixture(scope="module")
def gym_run(tmp_path_factory):
    pytest.importorskip("reasoning_gym")
    run_dir = tmp_path_factory.mktemp("runs") / "gym"
    tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}", *GYM)
    return run_dir


@pytest.mark.slow
def test_a_mix_of_over_a_hundred_domains_logs_each_domain(gym_run):
    domains = {
        json.loads(line)["domain"] for line in (gym_run / "data" / "train.jsonl").read_text().splitlines()
    }
    assert len(domains) >= 100
    rows = metrics(gym_run)
    trained = {
        k.split("/")[1] for r in rows for k in r if k.startswith("reward/") and k.split("/")[1] in domains
    }
    assert len(trained) >= 10
    validated = {k.split("/")[1] for r in rows for k in r if k.startswith("val/") and k.endswith("/pass@1")}
    assert len(validated & domains) >= 100
    summary = json.loads((gym_run / "summary.json").read_text())
    assert len(summary["per_domain_after"]) >= 100


@pytest.mark.slow
def test_a_killed_mixture_run_resumes_the_same_domain_sequence(gym_run, tmp_path):
    # The same tasks as the reference run: a few reasoning-gym generators iterate over sets of strings, so
    # their tasks depend on PYTHONHASHSEED (a run directory keeps its generated tasks for its resumes).
    same_tasks = [
        f"data.train_file={gym_run / 'data' / 'train.jsonl'}",
        f"data.heldout_file={gym_run / 'data' / 'heldout.jsonl'}",
    ]
    run_dir = tmp_path / "killed"
    kill_after_checkpoint(run_dir, 2, *GYM, *same_tasks)
    tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}", *GYM, *same_tasks)

    def domains(run):
        return [
            [
                json.loads(line)["domain"]
                for line in (run / "samples" / f"step_{s:06d}.jsonl").read_text().splitlines()
            ]
            for s in range(1, 7)
        ]

    assert domains(run_dir) == domains(gym_run)
    assert stable(metrics(run_dir)) == stable(metrics(gym_run))
