"""A code agent built on the OpenAI Agents SDK (`pip install openai-agents`), trained by tempering as it is.

Nothing here knows about tempering: the agent talks to an OpenAI-compatible `base_url` with an `api_key`, as it
would to any provider. It writes the function the task's prompt starts, runs the prompt's own examples on
it (in a child process with a time limit, inside the confinement tempering runs it in), and when one fails
it shows the failure and asks once more. It returns its final answer; tempering judges that on the hidden
tests and trains the model on the calls it recorded (`configs/agent-proxy.yaml`,
docs/guides/train-your-agent.md).
"""

import asyncio
import json
import subprocess
import sys

from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)  # the SDK would send traces to OpenAI; this agent's only network is the proxy
CHECK = """
import json, sys
namespace = {}
exec(sys.stdin.read(), namespace)
for args, expected in json.loads(sys.argv[1]):
    got = namespace[sys.argv[2]](*args)
    if got != expected:
        print(f"{sys.argv[2]}{tuple(args)!r} returned {got!r}, expected {expected!r}".replace(",)", ")"))
        sys.exit(1)
"""


def solve(task: dict, base_url: str, api_key: str) -> str:
    """The agent's entry point, as tempering calls it once per sample."""
    return asyncio.run(_solve(task, base_url, api_key))


async def _solve(task: dict, base_url: str, api_key: str) -> str:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    agent = Agent(name="coder", model=model)
    first = await Runner.run(agent, task["prompt"])
    answer = first.final_output
    failure = run_examples(task, answer)
    if failure is None:
        return answer
    try:
        again = await Runner.run(agent, first.to_input_list() + [{"role": "user", "content": failure}])
    except Exception:  # noqa: BLE001 - e.g. the context is full: keep the first answer
        return answer
    return again.final_output


def run_examples(task: dict, answer: str) -> str | None:
    """The first failing example as a sentence (None: all pass, or there are none to run)."""
    cases = [(e["input"], e["output"]) for e in task.get("examples") or [] if e.get("input") is not None]
    if not cases or not task.get("entry_point"):
        return None
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHECK, json.dumps(cases), task["entry_point"]],
            input=task["prompt"] + answer,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except subprocess.TimeoutExpired:
        return "It did not finish within 5 seconds. Write it again."
    if done.returncode == 0:
        return None
    lines = (done.stdout or done.stderr).strip().splitlines()
    return f"{lines[-1] if lines else 'It failed.'} Write it again."
