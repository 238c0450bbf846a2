"""Every algorithm recipe's settings on the smoke recipe, end to end; and exact resume with a critic and
adaptive KL (their state is in the checkpoint)."""

import json

import pytest
import yaml

from tests.helpers.runs import ROOT, kill_after_checkpoint, metrics, stable, tempering, train_tiny

ALGOS = ["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo_gae", "dapo"]


def algo_overrides(name: str) -> list[str]:
    """The algorithm-specific keys of configs/algos/NAME.yaml as overrides on top of the smoke recipe."""
    tree = yaml.safe_load((ROOT / "configs" / "algos" / f"{name}.yaml").read_text())
    out = []

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict) and k not in ("weights",):
                walk(v, [*prefix, k])
            else:
                out.append(f"{'.'.join([*prefix, k])}={json.dumps(v)}")

    walk({k: v for k, v in tree.items() if k in ("algo", "reward")}, [])
    return [o for o in out if not o.startswith("reward.params.overlong")] + (
        ["reward.params.overlong.max_tokens=24", "reward.params.overlong.cache_tokens=4"]
        if name == "dapo"
        else []
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ALGOS)
def test_each_algorithm_recipe_trains(name, tmp_path):
    run_dir = tmp_path / name
    tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}", "train.steps=3", *algo_overrides(name))
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("reward/hacking/exit_before_tests" in r for r in rows)
    trained = [r for r in rows if "actor/pg_loss" in r]
    if name == "ppo_gae":
        assert all("critic/vf_loss" in r for r in rows) and "actor/kl_coef" in rows[0]
        assert len(trained) == 0  # critic warm-up (5 steps): only the critic learns
        assert (run_dir / "checkpoints" / "step_000003" / "critic" / "value_head.pt").is_file()
    else:
        assert trained
    if name == "dapo":
        assert all("dapo/kept_groups" in r and r["dapo/rounds"] >= 1 for r in rows)
        # every round's generation and reward time is the step's (they were lost with the rounds' merge)
        assert all(r["timing_s/gen"] > 0 and r["timing_s/reward"] > 0 for r in rows)
    if name == "reinforce_pp":
        assert all("actor/reward_kl" in r for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.0 <= summary["heldout_pass@1_after"] <= 1.0


@pytest.mark.slow
def test_resume_with_a_critic_and_adaptive_kl_is_exact(tmp_path):
    extra = [*algo_overrides("ppo_gae"), "algo.critic.warmup_steps=1", "algo.kl_target=0.01", "train.steps=4"]
    reference = tmp_path / "ref"
    tempering("train", "configs/smoke.yaml", f"run.dir={reference}", *extra)
    run_dir = tmp_path / "killed"
    kill_after_checkpoint(run_dir, 2, *extra)
    tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}", *extra)
    rows, ref = stable(metrics(run_dir)), stable(metrics(reference))
    assert rows == ref
    assert (
        ref[-1]["actor/kl_coef"] != ref[0]["actor/kl_coef"]
    )  # the adaptive coefficient moved and was restored
    # Each step moves it as Ziegler et al.'s eq. 2 with n = the step's samples (4 prompts x 4), not 1.
    for a, b in zip(ref, ref[1:]):
        e = min(max(a["actor/reward_kl"] / 0.01 - 1.0, -0.2), 0.2)
        assert b["actor/kl_coef"] == pytest.approx(a["actor/kl_coef"] * (1 + e * 16 / 10000), rel=1e-9)


@pytest.mark.slow
def test_a_step_dynamic_sampling_leaves_empty_goes_on_to_the_next(tmp_path):
    """Tool tasks the tiny model never solves: every group of step 1 has equal scores, so dynamic sampling
    keeps none and the step trains nothing; step 2 is still sent with the weights of version 1."""
    run_dir = tmp_path / "run"
    train_tiny(run_dir, "train.steps=2", "algo.dynamic_sampling=true", "data.generator=tools")
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["actor/trained_fraction"] == 0.0 and rows[0]["dapo/kept_groups"] == 0.0
