"""Binding estimators and losses once (`training.algorithm`, `registry.bind`): the run's hyper-parameters reach
the functions that declare them, and a keyword a function does not take is a one-line ConfigError."""

import pytest
import torch

from tempering.algos import AdvantageInputs, LossInputs, dr_grpo, grpo, ppo_clip_loss
from tempering.config import build_config
from tempering.errors import ConfigError


def inputs():
    gen = torch.Generator().manual_seed(0)
    rewards, mask = torch.rand(8, generator=gen), torch.ones(8, 5)
    x = AdvantageInputs(rewards, mask, torch.arange(8) // 4)
    logprobs, old = torch.randn(8, 5, generator=gen) * 0.3, torch.randn(8, 5, generator=gen) * 0.3
    return x, LossInputs(logprobs, old, torch.randn(8, 5, generator=gen), mask)


def test_a_misspelt_hyper_parameter_is_an_error_not_silently_dropped():
    x, _ = inputs()
    with pytest.raises(TypeError, match="scale_by_sdt"):
        grpo(x, scale_by_sdt=False)  # no `**_` swallows it
    from tempering.registry import bind

    with pytest.raises(ConfigError) as e:
        bind(grpo, "grpo", "advantage estimator", scale_by_sdt=False)
    assert "advantage estimator 'grpo' cannot take" in str(e.value) and "scale_by_sdt" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_bound_function_carries_the_runs_hyper_parameters():
    from tempering.training.algorithm import bind_estimator, bind_policy_loss

    x, lx = inputs()
    cfg = build_config(
        {
            "algo": {"scale_by_std": False, "clip_ratio": 0.05, "loss_agg": "seq-mean-token-sum-norm"},
            "rollout": {"max_new_tokens": 7},
        }
    )
    torch.testing.assert_close(bind_estimator(cfg)(x)[0], dr_grpo(x)[0])  # grpo without the std
    loss, metrics = bind_policy_loss(cfg)(lx)
    want, want_metrics = ppo_clip_loss(lx, clip_ratio=0.05, loss_agg="seq-mean-token-sum-norm", norm_length=7)
    assert torch.equal(loss, want) and metrics.keys() == want_metrics.keys()
    assert not torch.equal(loss, ppo_clip_loss(lx)[0])


def lean_loss(x, *, loss_agg):
    """A user loss that declares only the keyword it uses."""
    return ppo_clip_loss(x, loss_agg=loss_agg)


def needy_loss(x, *, clip_ratoi):
    """A user loss whose required keyword (misspelt) is not one the run has."""
    return ppo_clip_loss(x, clip_ratio=clip_ratoi)


def test_a_user_loss_gets_the_keywords_it_declares_and_a_missing_one_fails_at_load_time():
    from tempering.training.algorithm import bind_policy_loss

    cfg = build_config(
        {
            "algo": {
                "policy_loss": "tests.training.test_algorithm:lean_loss",
                "loss_agg": "seq-mean-token-mean",
            }
        }
    )
    _, lx = inputs()
    assert torch.equal(bind_policy_loss(cfg)(lx)[0], ppo_clip_loss(lx, loss_agg="seq-mean-token-mean")[0])
    with pytest.raises(ConfigError) as e:
        build_config({"algo": {"policy_loss": "tests.training.test_algorithm:needy_loss"}})
    assert "algo.policy_loss: policy loss 'tests.training.test_algorithm:needy_loss' cannot take" in str(
        e.value
    )
    assert "clip_ratoi" in str(e.value) and "\n" not in str(e.value)


def test_the_update_settings_are_read_from_the_config_once():
    from tempering.training.update import UpdateSettings

    cfg = build_config(
        {
            "algo": {
                "ppo_epochs": 3,
                "minibatches": 4,
                "loss_agg": "seq-mean-token-sum",
                "entropy_coef": 0.01,
                "max_grad_norm": 0.5,
                "kl_estimator": "k2",
            },
            "rollout": {"temperature": 0.7},
            "model": {"gradient_checkpointing": True},
        }
    )
    assert UpdateSettings.from_config(cfg) == UpdateSettings(
        epochs=3,
        minibatches=4,
        loss_agg="seq-mean-token-sum",
        kl_estimator="k2",
        entropy_coef=0.01,
        max_grad_norm=0.5,
        temperature=0.7,
        gradient_checkpointing=True,
        compute=torch.float32,
    )
