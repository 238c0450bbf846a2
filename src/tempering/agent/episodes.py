"""Episodes of the user's own agent: the half of the episode driver that runs when `agent.entry` (or
`agent.command`) is set. `sample_episodes` is what the rollout source and evaluation call: the agent's runs
when the run names one, else `rollout.episodes.run_episodes` - so training, validation and evaluation all
run the agent, and what comes back are the same `Episode` records the trainer collates.

Each sample is one run of the agent (`agent.runner`: confined, with a time limit) against a recording
session the driver opened on its proxy (`agent.proxy`): the session samples at the rollout's temperature and
top-p (greedy for greedy evaluation) with a seed drawn like the built-in driver's, whatever the agent asks,
so the recorded log-probs are the distribution the trainer computes and a rerun samples the same. The run's
record is the branch that holds its last call (`SessionRecord`: prompt ids as the engine computed them, the
sampled ids with their log-probs and versions, a mask on the model's own tokens); other branches (an
agent that rewrote its history) are counted in `proxy/forks` and not trained on. The reward: the task's
environment judges the agent's final answer - what its function returned (or the command printed), else
its last reply - as the built-in driver would judge a one-turn episode (`agent.reward: env`); or the
reward the agent posted to its session (`agent`, component `agent`); or both. A run that failed or timed
out is trained on as far as it got (nothing, if it made no call) and counted in `agent/failed`.
"""

from __future__ import annotations

import atexit
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import nullcontext

import torch

from tempering.agent.proxy import Proxy
from tempering.agent.runner import AgentRunner
from tempering.agent.sessions import Sampling, SessionLimits, SessionRecord
from tempering.envs import EnvContext, make_env, step_all
from tempering.errors import TemperingError
from tempering.inference.chat import chat_format
from tempering.rollout.episodes import run_episodes
from tempering.types import Episode, Task, Turn

_RUNTIMES: dict[object, AgentRuntime] = {}
"""Engine -> its runtime, until `close_agents` (or the process's exit) closes it."""


class AgentRuntime:
    """One engine's proxy and the agent's fork server, started at the first agent rollout."""

    def __init__(self, engine, ctx: EnvContext, fmt, max_context: int):
        g = ctx.agent
        limits = SessionLimits(
            max_sessions=4 * g.concurrency, max_tokens=8 * max_context, idle_s=g.timeout_s + 60
        )
        self.proxy = Proxy(engine, fmt, max_context, limits, g.concurrency, g.patience_s)
        try:
            self.runner = AgentRunner(g, self.proxy.socket, hidden=list(ctx.hidden))
        except BaseException:
            self.proxy.close()
            raise
        self.concurrency, self.timeout_s, self.patience_s = g.concurrency, g.timeout_s, g.patience_s

    def run(self, jobs: list[tuple[dict, Sampling]]) -> list[tuple[dict, SessionRecord | None]]:
        """Each (task, sampling) run once in a session of its own, at most `concurrency` at a time: their
        (report, record), in order. The first runs join the lockstep together, and a run joins it before
        the one it replaces leaves it, so every batch is every running agent's. When all have reported,
        what a killed run left waiting is cancelled, and nothing runs on the engine any more."""
        lockstep, out = self.proxy.lockstep, [None] * len(jobs)
        todo, active = iter(range(len(jobs))), {}
        first = min(self.concurrency, len(jobs))
        lockstep.expect(first)

        def launch(counted: bool) -> None:
            i = next(todo, None)
            if i is None:
                return lockstep.done_one() if counted else None
            if not counted:
                lockstep.expect(1)
            try:
                session = self.proxy.open(jobs[i][1])
                active[self.runner.run(i, jobs[i][0], session.key)] = (i, session)
            except BaseException:
                lockstep.done_one()
                raise

        try:
            for _ in range(first):
                launch(counted=True)
            while active:
                done, _ = wait(
                    list(active), timeout=self.patience_s + self.timeout_s + 60, return_when=FIRST_COMPLETED
                )
                if not done:
                    raise TemperingError(
                        f"no agent run reported in {self.timeout_s + 60:.0f} s past its time limit"
                    )
                for future in sorted(done, key=lambda f: active[f][0]):
                    i, session = active.pop(future)
                    out[i] = (future.result(), (self.proxy.finish(session) or [None])[-1])
                    launch(counted=False)
                    lockstep.done_one()
        finally:
            lockstep.drain()
        return out

    def close(self) -> None:
        self.runner.close()
        self.proxy.close()


def runtime_for(engine, ctx: EnvContext, fmt, max_context: int) -> AgentRuntime:
    runtime = _RUNTIMES.get(engine)
    if runtime is None:
        runtime = _RUNTIMES[engine] = AgentRuntime(engine, ctx, fmt, max_context)
        atexit.register(runtime.close)
    return runtime


def close_agents(engine) -> None:
    """Stop `engine`'s proxy and agent server, if it has them (an evaluation's engine, when it is done)."""
    runtime = _RUNTIMES.pop(engine, None)
    if runtime is not None:
        atexit.unregister(runtime.close)
        runtime.close()


def public(task: Task) -> dict:
    """What the agent is told of its task: never its hidden tests, answer or reference solution."""
    return task.model_dump(include={"id", "domain", "prompt", "entry_point", "language", "examples"})


def sample_episodes(engine, tasks: list[Task], ctx: EnvContext, **options) -> list[Episode]:
    """The episodes of `tasks`, as `run_episodes(engine, tasks, ctx, **options)` documents them: run by the
    user's agent when `ctx.agent` names one (its time is the `timer`'s `gen`), else by the policy acting
    in its environments."""
    if ctx.agent is None:
        return run_episodes(engine, tasks, ctx, **options)
    timer = options.pop("timer", None) or (lambda name: nullcontext())
    fmt = chat_format(engine.tokenizer, options.pop("chat", "auto"))
    options.pop("stop", None)
    with timer("gen"):
        return run_agent_episodes(engine, tasks, ctx, fmt, **options)


def run_agent_episodes(
    engine,
    tasks: list[Task],
    ctx: EnvContext,
    fmt,
    *,
    group_size: int,
    max_context: int,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    seed: int = 0,
    first_task: int = 0,
) -> list[Episode]:
    """`group_size` runs of the agent per task (consecutive), as `run_episodes` documents its episodes."""
    runtime = runtime_for(engine, ctx, fmt, max_context)
    n, s = len(tasks) * group_size, engine.sampling
    seeds = torch.randint(0, 1 << 62, (n,), generator=generator).tolist()
    temperature = 0.0 if greedy else s.temperature
    runs = runtime.run(
        [
            (public(tasks[i // group_size]), Sampling(temperature, s.top_p, s.max_new_tokens, x))
            for i, x in enumerate(seeds)
        ]
    )
    reports, records = [r for r, _ in runs], [x for _, x in runs]
    index = [first_task * group_size + i for i in range(n)]
    envs = [
        make_env(tasks[i // group_size], ctx, seed=seed * 100_003 + k, group_id=k // group_size)
        for i, k in enumerate(index)
    ]
    prompts = [fmt.start(env.reset(tasks[i // group_size]))[0] for i, env in enumerate(envs)]
    answers = [_answer(report, record) for report, record in zip(reports, records)]
    steps = [None] * n
    if ctx.agent.reward != "agent":
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="env") as pool:
            steps = step_all(envs, answers, pool)
    engine.release()
    return [
        _episode(
            tasks[i // group_size],
            envs[i],
            prompts[i],
            records[i],
            reports[i],
            answers[i],
            steps[i],
            engine,
            ctx.agent.reward,
        )
        for i in range(n)
    ]


def _answer(report: dict, record: SessionRecord | None) -> str:
    if report.get("answer") is not None:
        return report["answer"]
    return record.texts[-1] if record and record.texts else ""


def _episode(task, env, prompt, record, report, answer, step, engine, mode) -> Episode:
    """The run as a plain episode: the record's tokens after its first prompt, one turn per call, the last
    turn carrying the judgement (and the agent's reward)."""
    outcome = set(type(env).outcome) if mode != "agent" else set()
    weights = dict(type(env).default_weights) if mode != "agent" else {}
    if mode != "env":
        outcome.add("agent")
        weights["agent"] = 1.0
    failed = report.get("status") != "ok"
    e = Episode(
        task,
        env.group_id,
        prompt,
        weights,
        frozenset(outcome),
        done=True,
        truncated=report.get("status") == "timeout",
    )
    e.version = engine.version
    e.proxy = {"failed": float(failed), "timeout": float(e.truncated)}
    if record is not None:
        _take(e, record, engine)
    last = e.turns[-1] if e.turns else Turn(answer, None, {}, ended=False, tokens=0)
    judged = (
        step.as_turn(answer, ended=last.ended, tokens=last.tokens)
        if step is not None
        else Turn(answer, None, {}, ended=last.ended, tokens=last.tokens)
    )
    if mode != "env":
        reward = float(record.reward) if record is not None and record.reward is not None else 0.0
        judged.rewards["agent"] = reward
        judged.success = judged.success or (mode == "agent" and reward > 0)
    e.turns[-1:] = [judged]
    return e


def _take(e: Episode, record: SessionRecord, engine) -> None:
    """The record's tokens after its first prompt, and one turn per call (its reply, what followed it)."""
    first = record.mask.index(True)
    e.prompt_ids, e.ids = record.ids[:first], record.ids[first:]
    e.policy, e.logprobs = record.mask[first:], record.logprobs[first:]
    e.turn_ends = [end - first for end in record.ends]
    e.version = min(v for v, m in zip(record.versions, record.mask) if m)
    e.proxy["forks"] = float(record.forks)
    e.proxy["token_exact_fraction"] = record.token_exact_fraction
    if record.rerender_exact_fraction is not None:
        e.proxy["rerender_exact_fraction"] = record.rerender_exact_fraction
    starts = [0] + [end + 1 for end in e.turn_ends[:-1]]
    for k, (text, start, end) in enumerate(zip(record.texts, starts, e.turn_ends)):
        following = e.turn_ends[k + 1] + 1 if k + 1 < len(e.turn_ends) else end + 1
        observed = [t for t, p in zip(e.ids[end + 1 : following], e.policy[end + 1 : following]) if not p]
        e.turns.append(
            Turn(
                text,
                engine.tokenizer.decode(observed) if observed else None,
                {},
                ended=e.ids[end] in engine.stop_ids,
                tokens=sum(e.policy[start : end + 1]),
            )
        )
