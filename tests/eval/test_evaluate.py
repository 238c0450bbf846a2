import torch

from tempering.envs import EnvContext
from tempering.eval.evaluate import evaluate
from tempering.inference.engine import LocalEngine, SamplingParams
from tests.helpers.engines import ScriptedEngine


def test_report_counts_correct_samples_per_domain(tiny, tasks, sandbox):
    model, tokenizer = tiny
    _, heldout = tasks
    by_prompt = {t.prompt: t for t in heldout}

    def answer(turn, context):
        """The reference body for arithmetic tasks, garbage elsewhere (the policy's answers replaced)."""
        task = next(t for p, t in by_prompt.items() if context.endswith(p) or p in context)
        return task.reference_solution.split("\n", 1)[1] if task.domain == "arithmetic" else "    return 0\n"

    report = evaluate(ScriptedEngine(tokenizer, answer), heldout, EnvContext(sandbox), samples=3, ks=(1, 2))
    n_arith = sum(t.domain == "arithmetic" for t in heldout)
    assert report.per_domain["arithmetic"] == {"pass@1": 1.0, "pass@2": 1.0}
    assert abs(report.overall["pass@1"] - n_arith / len(heldout)) < 1e-9
    assert report.domain_tasks["arithmetic"] == n_arith and report.num_tasks == len(heldout)
    assert report.per_task[next(t.id for t in heldout if t.domain == "arithmetic")] == 3


def test_real_model_eval_runs_and_is_seeded(tiny, tasks, sandbox):
    model, tokenizer = tiny
    _, heldout = tasks
    engine = LocalEngine(model, tokenizer, SamplingParams(max_new_tokens=8))
    ctx = EnvContext(sandbox)
    a = evaluate(engine, heldout[:6], ctx, samples=2, ks=(1, 2), seed=5)
    b = evaluate(engine, heldout[:6], ctx, samples=2, ks=(1, 2), seed=5)
    assert a == b and set(a.overall) == {"pass@1", "pass@2"}
    g = evaluate(engine, heldout[:6], ctx, greedy=True, ks=(1, 5))
    assert g.samples == 1 and g.temperature is None and set(g.overall) == {"pass@1"}
    assert torch.is_grad_enabled()  # evaluation leaves autograd as it found it
    turns = evaluate(engine, heldout[:6], EnvContext(sandbox, max_turns=2), samples=2, seed=5)
    assert set(turns.overall) == {"pass@1", "first_turn_pass@1", "turns/mean"}
