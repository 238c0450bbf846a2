"""`sft.stop_at`: SFT stops at the first validation check that reaches a pass rate, on training functions
held out of its examples; the checks themselves change no weight."""

import json

import torch

from tempering.config import load_config
from tempering.data import function_key
from tempering.models.loading import load_model
from tempering.start import base_model_dir, sft_stage
from tempering.workspace import make_sandbox, prepare
from tests.helpers.runs import ROOT


def workspace(run_dir, *overrides):
    cfg = load_config(ROOT / "configs/smoke.yaml", [f"run.dir={run_dir}", *overrides])
    return prepare(cfg)


def sft(ws):
    with make_sandbox(ws.cfg) as sandbox:
        return sft_stage(ws, base_model_dir(ws, sandbox), sandbox)


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "sft" / "metrics.jsonl").read_text().splitlines()]


def test_sft_stops_at_the_first_check_that_reaches_the_target(tmp_path, monkeypatch):
    from tempering import start

    scripted = iter([0.0, 0.1, 0.4, 0.9])
    checked = []

    def fake_check(ws, model, tokenizer, ctx):
        def check(step):
            checked.append(step)
            return {"sft/val/pass@1": next(scripted), "sft/val/greedy_pass@1": 0.0}

        return check

    monkeypatch.setattr(start, "sft_check", fake_check)
    ws = workspace(tmp_path / "run", "sft.stop_at=0.3", "sft.check_every=4", "sft.steps=20")
    # The validation tasks are training functions SFT never sees.
    assert len(ws.sft_val_tasks) == ws.cfg.eval.val_tasks
    assert not {function_key(t) for t in ws.sft_val_tasks} & {function_key(t) for t in ws.sft_tasks}
    assert not {t.id for t in ws.sft_val_tasks} & {t.id for t in ws.heldout_tasks}
    sft(ws)
    assert checked == [4, 8, 12]  # 0.4 >= 0.3 at the third check: no fourth
    assert json.loads((tmp_path / "run" / "sft" / "DONE.json").read_text())["steps"] == 12
    assert [r["step"] for r in rows(tmp_path / "run")] == list(range(1, 13))
    assert [r.get("sft/val/pass@1") for r in rows(tmp_path / "run")][3::4] == [0.0, 0.1, 0.4]


def test_the_checks_leave_the_weights_and_the_steps_as_they_were(tmp_path):
    """A target never reached: the checks run (real validation in the sandbox) and SFT ends at `steps` with
    the very weights of a run on the same split that checks only after its last step."""
    common = ["sft.stop_at=1.0", "sft.steps=8"]
    checked = workspace(tmp_path / "a", *common, "sft.check_every=3")
    unchecked = workspace(tmp_path / "b", *common, "sft.check_every=1000")
    assert checked.sft_tasks == unchecked.sft_tasks
    a, b = sft(checked), sft(unchecked)
    vals = [r for r in rows(tmp_path / "a") if "sft/val/pass@1" in r]
    assert [r["step"] for r in vals] == [3, 6]
    assert all(0.0 <= r[k] <= 1.0 for r in vals for k in ("sft/val/pass@1", "sft/val/greedy_pass@1"))
    assert not any("sft/val/pass@1" in r for r in rows(tmp_path / "b"))
    wa, wb = load_model(a).state_dict(), load_model(b).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert json.loads((tmp_path / "a" / "sft" / "DONE.json").read_text())["steps"] == 8


def test_without_stop_at_sft_holds_every_training_task(tmp_path):
    ws = workspace(tmp_path / "run")
    assert ws.sft_val_tasks == [] and ws.sft_tasks == ws.train_tasks
