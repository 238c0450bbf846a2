import torch

from tempering.eval.evaluate import evaluate


def test_report_counts_correct_samples_per_domain(tiny, tasks, sandbox, monkeypatch):
    model, tokenizer = tiny
    _, heldout = tasks
    # Replace the policy's answers: the reference body for arithmetic tasks, garbage elsewhere.
    import tempering.eval.evaluate as ev

    def fake_rollout(model, tokenizer, tasks, sandbox, group_size, **kw):
        from tempering.rollout.code import execute
        from tempering.types import Trajectory

        trajs = []
        for g, task in enumerate(tasks):
            body = task.reference_solution.split("\n", 1)[1] if task.domain == "arithmetic" else "    return 0\n"
            trajs += [Trajectory(task=task, group_id=g, completion=body, truncated=False) for _ in range(group_size)]
        execute(trajs, sandbox)
        return trajs, None

    monkeypatch.setattr(ev, "rollout", fake_rollout)
    report = evaluate(model, tokenizer, heldout, sandbox, samples=3, ks=(1, 2))
    n_arith = sum(t.domain == "arithmetic" for t in heldout)
    assert report.per_domain["arithmetic"] == {"pass@1": 1.0, "pass@2": 1.0}
    assert abs(report.overall["pass@1"] - n_arith / len(heldout)) < 1e-9
    assert report.domain_tasks["arithmetic"] == n_arith and report.num_tasks == len(heldout)
    assert report.per_task[next(t.id for t in heldout if t.domain == "arithmetic")] == 3


def test_real_model_eval_runs_and_is_seeded(tiny, tasks, sandbox):
    model, tokenizer = tiny
    _, heldout = tasks
    a = evaluate(model, tokenizer, heldout[:6], sandbox, samples=2, ks=(1, 2), seed=5, max_new_tokens=8)
    b = evaluate(model, tokenizer, heldout[:6], sandbox, samples=2, ks=(1, 2), seed=5, max_new_tokens=8)
    assert a == b and set(a.overall) == {"pass@1", "pass@2"}
    g = evaluate(model, tokenizer, heldout[:6], sandbox, greedy=True, ks=(1, 5), max_new_tokens=8)
    assert g.samples == 1 and g.temperature is None and set(g.overall) == {"pass@1"}
    assert torch.is_grad_enabled()  # evaluation leaves autograd as it found it
