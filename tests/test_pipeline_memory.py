"""The process's memory between the stages of `tempering train`."""

import weakref
from pathlib import Path

import pytest

from tempering import pipeline
from tempering.config import load_config
from tempering.state import TrainState

ROOT = Path(__file__).resolve().parents[1]
QUICK = [
    "sft.steps=4",
    "sft.batch_size=4",
    "train.steps=2",
    "data.num_train=40",
    "data.num_heldout=4",
    "eval.samples=1",
    "eval.every=0",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "tracking.tensorboard=false",
    "tracking.samples_every=0",
    "tracking.progress=false",
]


@pytest.mark.slow
def test_the_trained_policy_is_freed_before_the_final_evaluation_loads_the_final_model(tmp_path, monkeypatch):
    """The RL stage's policy sits in reference cycles (modules, hooks, the engine); the evaluation after RL
    loads the final model from disk, so the policy must be gone by then, or the run's peak memory holds both."""
    policies, alive = [], []
    build, evaluate = TrainState.build_or_resume.__func__, pipeline.heldout_eval

    def build_or_resume(cls, *args, **kwargs):
        state = build(cls, *args, **kwargs)
        policies.append(weakref.ref(state.policy))
        return state

    def heldout_eval(ws, model_dir, sandbox, name, *args, **kwargs):
        if name == "eval_after":
            alive.append([p() is not None for p in policies])
        return evaluate(ws, model_dir, sandbox, name, *args, **kwargs)

    monkeypatch.setattr(TrainState, "build_or_resume", classmethod(build_or_resume))
    monkeypatch.setattr(pipeline, "heldout_eval", heldout_eval)
    monkeypatch.chdir(ROOT)
    pipeline.train(load_config(ROOT / "configs/smoke.yaml", [f"run.dir={tmp_path / 'run'}", *QUICK]))
    assert alive == [[False]]
