"""verifiers adapter: a taskset written for verifiers 0.4 (`pip install 'tempering[verifiers]'`) as tasks
and their environment.

verifiers' environments are tasksets (`verifiers.v1`): an installed package exporting a `Taskset` whose
`load()` yields `Task`s, each with typed data (its prompt) and `@vf.reward` / `@vf.metric` methods that
score a trace. `verifiers_tasks` loads one by its id through verifiers' own loader and writes its tasks as
tempering tasks (`python -m tempering.envs.verifiers TASKSET_ID OUT_DIR`), each naming its environment
`verifiers:TASKSET_ID` (list that string in `env.plugins`) and keeping the task's data in its metadata; a
data field `answer`, where the taskset has one, becomes the task's reference solution (for SFT).

An episode is one turn: the prompt is the task's system prompt and prompt; the model's reply becomes the
assistant message of a verifiers trace, and the task scores it with its own rewards - weighted as the
taskset weights them - into the `verifiers` component (an outcome). Each reward's score and each metric
are kept in the turn's info. Rewards or metrics that take a `runtime` get verifiers' subprocess runtime (a
scratch directory on this machine; the task's `setup` runs in it first); none gets a remote sandbox.
`success` is every reward at full score; a reply on which the task's scoring fails (verifiers' TaskError)
scores 0, the error kept in the turn's info.

Not covered: multi-turn environments (an `Env.run` with its own user or game loop), harnesses (agents
verifiers runs), and judges, which call a model over an API.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import sys
from pathlib import Path
from typing import Any

from tempering.envs.base import Environment, Step
from tempering.errors import ConfigError
from tempering.types import Task


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError(
            "verifiers is not installed: pip install 'tempering[verifiers]' (or verifiers==0.4.0)"
        ) from None
    return vf


@functools.cache
def load_taskset(taskset_id: str, options: str = "{}") -> Any:
    """verifiers' taskset `taskset_id` with its config's fields `options` (JSON); ConfigError naming what
    is wrong (the package is missing, exports no taskset, an option is unknown)."""
    vf = _vf()
    try:
        config = vf.taskset_config_type(taskset_id).model_validate({**json.loads(options), "id": taskset_id})
        return vf.load_taskset(config)
    except Exception as e:  # noqa: BLE001 - a taskset may fail to import or validate in any way
        raise ConfigError(f"verifiers taskset '{taskset_id}': {type(e).__name__}: {e}") from None


@functools.cache
def verifiers_environment(taskset_id: str) -> type[Environment]:
    """The tempering environment of verifiers' taskset `taskset_id` (loaded now, so a bad id fails here)."""
    load_taskset(taskset_id)
    return type(f"Verifiers_{taskset_id}", (VerifiersEnv,), {"kind": f"verifiers:{taskset_id}"})


def verifiers_tasks(taskset_id: str, options: dict[str, Any] | None = None) -> list[Task]:
    """Every task of the taskset, as tempering tasks of the environment `verifiers:taskset_id`."""
    text = json.dumps(options or {}, sort_keys=True)
    taskset = load_taskset(taskset_id, text)
    tasks = []
    for vf_task in taskset:
        data = vf_task.data
        tasks.append(
            Task(
                id=str(data.id if data.id is not None else data.idx),
                domain=taskset_id,
                env=f"verifiers:{taskset_id}",
                prompt=_prompt(data),
                reference_solution=getattr(data, "answer", None),
                metadata={
                    "verifiers": {
                        "options": text,
                        "data": data.model_dump(mode="json", exclude_defaults=True),
                    }
                },
            )
        )
    return tasks


def _prompt(data: Any) -> str:
    return f"{data.system_prompt}\n\n{data.prompt_text}" if data.system_prompt else data.prompt_text


def _needs_runtime(fn: Any) -> bool:
    """Whether a reward or metric takes a runtime it has no default for (verifiers' own test)."""
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


class VerifiersEnv(Environment):
    """One episode of a verifiers task (a subclass per taskset: `verifiers_environment`)."""

    kind = "verifiers"
    components = outcome = frozenset({"verifiers"})
    default_weights = {"verifiers": 1.0}

    def reset(self, task: Task) -> str:
        record = task.metadata.get("verifiers") or {}
        taskset = load_taskset(self.kind.partition(":")[2], record.get("options", "{}"))
        task_cls = type(taskset).task_type()
        self.vf_task = task_cls(
            task_cls.data_type().model_validate(record.get("data") or {}), taskset.config.task
        )
        return task.prompt

    def step(self, action: str) -> Step:
        try:
            trace = asyncio.run(self._score(action))
        except _vf().TaskError as e:  # a reward that fails on this reply (reported by verifiers) scores 0
            return Step(None, {"verifiers": 0.0}, True, {"error": str(e)})
        rewards = {name: r.score for name, r in trace.rewards.items() if r is not None}
        info = {"rewards": rewards, "metrics": dict(trace.metrics)}
        success = bool(rewards) and all(score >= 1.0 for score in rewards.values())
        return Step(None, {"verifiers": float(trace.reward)}, True, info, success)

    async def _score(self, reply: str) -> Any:
        """A trace of the prompt and `reply`, scored by the task (in a subprocess runtime if it asks for one)."""
        vf = _vf()
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, TraceTask

        data = self.vf_task.data
        trace = vf.Trace(
            task=TraceTask(type=type(self.vf_task).__name__, data=data),
            agent=AgentInfo(config=vf.AgentConfig()),
        )
        trace.nodes.append(MessageNode(message=vf.UserMessage(content=_prompt(data))))
        trace.nodes.append(MessageNode(parent=0, message=vf.AssistantMessage(content=reply), sampled=True))
        hooks = [*self.vf_task.hooks("reward"), *self.vf_task.hooks("metric")]
        if not any(_needs_runtime(fn) for fn in hooks):
            await self.vf_task.score(trace)
            return trace
        from verifiers.v1.runtimes.subprocess import SubprocessRuntime

        runtime = SubprocessRuntime(vf.SubprocessConfig())
        await runtime.start()
        try:
            await self.vf_task.setup(trace, runtime)
            await self.vf_task.score(trace, runtime)
        finally:
            await runtime.teardown()
        return trace


def write(taskset_id: str, out: Path, num_heldout: int, options: dict[str, Any] | None = None) -> None:
    """OUT/train.jsonl and OUT/heldout.jsonl: the taskset's tasks, its last `num_heldout` held out."""
    tasks = verifiers_tasks(taskset_id, options)
    if len(tasks) <= num_heldout:
        raise ConfigError(
            f"verifiers taskset '{taskset_id}' has {len(tasks)} tasks; {num_heldout} held out leaves none"
        )
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", tasks[:-num_heldout]), ("heldout", tasks[-num_heldout:])):
        (out / f"{name}.jsonl").write_text(
            "".join(t.model_dump_json(exclude_defaults=True) + "\n" for t in part)
        )


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tempering.envs.verifiers", description=write.__doc__)
    parser.add_argument("taskset_id")
    parser.add_argument("out", type=Path)
    parser.add_argument("--heldout", type=int, default=16, help="tasks held out (the last ones)")
    parser.add_argument("--options", default="{}", help="the taskset config's fields, as JSON")
    args = parser.parse_args(argv)
    try:
        write(args.taskset_id, args.out, args.heldout, json.loads(args.options))
    except (ConfigError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
