"""Sampling throughput of the engine against Hugging Face `model.generate` and vLLM, like for like.

    .venv/bin/python bench/engine_throughput.py [MODEL] [--prompts 4 8] [--max-new 256] [--samples 8]
        [--precision bf16 fp32] [--repeats 3] [--vllm .venv-vllm/bin/python] [--no-hf] [--threads 2]

HumanEval prompts in the model's chat template (default model: smollm2-135m-instruct), P distinct prompts
x `--samples` samples each, temperature 1.0, full softmax, stopping at the model's stop tokens. Tokens/s
counts the tokens actually generated (up to and including a stop token) over the wall time of the whole
call, prefill included.

Every arm runs at each `--precision`: the engine sampling from its bf16 copy (`model.compute: bfloat16`)
or the fp32 model, HF generate on a bf16 copy or the fp32 model, vLLM's CPU build with `dtype` bfloat16 or
float32 (one vLLM process per precision, started once, fed the same prompts as the others). Ratios are
against the peer at the same precision. Arms alternate: each of `--repeats` rounds runs every arm once,
in turn, and the table shows each arm's median. Beside it, the matmul ceiling at the same rows, measured
in the same run (`bench/ceiling.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import signal
import statistics
import subprocess
import time

import torch
from ceiling import decode_ceiling  # bench/, beside this script
from record import write_record

from tempering.checkpoint import resolve_model
from tempering.data.benchmarks import humaneval_tasks
from tempering.inference.chat import chat_format, stop_token_ids
from tempering.inference.engine import LocalEngine, SamplingParams, make_engine
from tempering.models.loading import load_model, load_tokenizer

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

VLLM_WORKER = r"""
import json, sys, time
from vllm import LLM, SamplingParams, TokensPrompt
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], gpu_memory_utilization=0.2, max_model_len=2048, seed=0)
print(json.dumps({"ready": True, "dtype": str(llm.llm_engine.model_config.dtype)}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    params = SamplingParams(n=job["samples"], temperature=1.0, top_p=1.0, max_tokens=job["max_new"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    started = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    print(json.dumps({"tokens": sum(len(c.token_ids) for o in out for c in o.outputs), "wall": wall}), flush=True)
"""


class VLLMArm:
    """A vLLM process of its own at one precision, kept for the whole run and fed jobs on stdin."""

    def __init__(self, python: str, model_dir: str, precision: str, threads: int):
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_TARGET_DEVICE": "cpu"}
        dtype = {"bf16": "bfloat16", "fp32": "float32"}[precision]
        self.process = subprocess.Popen(
            [python, "-c", VLLM_WORKER, model_dir, dtype],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(os.environ.get("VLLM_LOG", os.devnull), "a"),
            text=True,
            env=env,
            start_new_session=True,  # vLLM's engine and worker processes with it: `close` ends them all
        )
        self.dtype = self._reply()["dtype"]  # what vLLM itself says it runs in

    def _reply(self) -> dict:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the vLLM worker exited (rc {self.process.wait()})")

    def __call__(self, prompts: list[list[int]], samples: int, max_new: int) -> tuple[int, float]:
        assert self.process.stdin is not None
        self.process.stdin.write(
            json.dumps({"prompts": prompts, "samples": samples, "max_new": max_new}) + "\n"
        )
        self.process.stdin.flush()
        reply = self._reply()
        return reply["tokens"], reply["wall"]

    def close(self) -> None:
        """End the worker and the processes vLLM started under it (left running, they took the CPU and
        memory of every later run: found as four live workers after four runs)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def engine_arm(
    engine: LocalEngine, prompts: list[list[int]], samples: int, max_new: int
) -> tuple[int, float]:
    engine.sampling = SamplingParams(1.0, 1.0, max_new)
    contexts = [p for p in prompts for _ in range(samples)]
    started = time.perf_counter()
    gen = engine.generate(contexts, generator=torch.Generator().manual_seed(0))
    return int(gen.response_mask.sum()), time.perf_counter() - started


def hf_arm(
    model, prompts: list[list[int]], samples: int, max_new: int, stops: list[int], pad: int
) -> tuple[int, float]:
    width = max(map(len, prompts))
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts for _ in range(samples)], device=device)
    starts = torch.tensor([width - len(p) for p in prompts for _ in range(samples)], device=device)
    mask = torch.arange(width, device=device)[None] >= starts[:, None]
    torch.manual_seed(0)
    started = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask.long(),
        max_new_tokens=max_new,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        eos_token_id=stops,
        pad_token_id=pad,
    )
    wall = time.perf_counter() - started
    new = out[:, width:]
    ended = torch.isin(new, torch.tensor(stops, device=device))
    after = (ended.cumsum(1) - ended.long()) > 0  # tokens after the first stop are padding
    return int((~after).sum()), wall


def build_arms(args, model, tokenizer, model_dir: str, workers: list[VLLMArm]) -> dict:
    """(arm, precision) -> a callable(prompts, samples, max_new) -> (tokens, wall); the vLLM processes
    started go into `workers` as they start (for the caller to close, even if a later one fails)."""
    stops = list(stop_token_ids(tokenizer, model))  # the ones the engine stops on
    pad = tokenizer.pad_token_id
    arms = {}
    for precision in args.precision:
        dtype = DTYPES[precision]
        engine = make_engine(model, tokenizer, dtype=dtype)  # float32: the model's own
        arms["engine", precision] = lambda p, s, m, e=engine: engine_arm(e, p, s, m)
        if not args.no_hf:
            hf = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
            arms["HF", precision] = lambda p, s, m, h=hf: hf_arm(h, p, s, m, stops, pad)
        if args.vllm:
            worker = VLLMArm(args.vllm, model_dir, precision, args.threads)
            print(f"vLLM {precision}: the worker runs in {worker.dtype}", flush=True)
            workers.append(worker)
            arms["vLLM", precision] = worker
    return arms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, nargs="+", default=[4, 8])
    p.add_argument("--max-new", type=int, nargs="+", default=[256])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--precision", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    p.add_argument("--repeats", type=int, default=1, help="rounds of every arm in turn; medians reported")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--device", default="cpu", help="where the engine and HF arms run (cuda: `make gpu-check`)"
    )
    p.add_argument("--vllm", help="python of a venv with vllm-cpu (make vllm): adds the vLLM arms")
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate arms")
    p.add_argument("--record", metavar="PATH", help="also write the engine's bf16 figures as a result record")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    model, tokenizer = load_model(model_dir, device=args.device).eval(), load_tokenizer(model_dir)
    fmt = chat_format(tokenizer, "auto")
    tasks = humaneval_tasks()
    rates: dict[str, float] = {}
    workers: list[VLLMArm] = []
    try:
        arms = build_arms(args, model, tokenizer, str(model_dir), workers)
        warm = [fmt.start(tasks[-1].prompt)[0]]
        for arm in arms.values():
            arm(warm, 2, 8)
        for max_new in args.max_new:
            for n in args.prompts:
                prompts = [fmt.start(t.prompt)[0] for t in tasks[:n]]
                runs: dict = {key: [] for key in arms}
                for _ in range(args.repeats):
                    for key, arm in arms.items():
                        runs[key].append(arm(prompts, args.samples, max_new))
                rates |= report(model, n, args.samples, max_new, runs, args.precision)
    finally:
        for worker in workers:
            worker.close()
    if args.record:
        record(args, rates)


def report(model, n: int, samples: int, max_new: int, runs: dict, precisions: list[str]) -> dict[str, float]:
    """Print one configuration's table (medians; ratios against the peers at the same precision)."""
    rows = n * samples
    ceilings = {pr: decode_ceiling(model, rows, DTYPES[pr])["tokens_per_s"] for pr in precisions}
    print(
        f"\n{n} prompts x {samples}, {max_new} new tokens ({rows} rows); matmul ceiling at {rows} rows: "
        + ", ".join(f"{pr} {c:.0f} tokens/s" for pr, c in ceilings.items())
    )
    print(
        f"{'arm':<7} {'precision':<9} {'tokens':>7} {'wall s':>7} {'tok/s':>7} {'each run':<22} "
        f"{'vs HF':>6} {'vs vLLM':>8} {'of ceiling':>10}"
    )
    median = {key: statistics.median(t / w for t, w in got) for key, got in runs.items()}
    rates = {}
    for (arm, precision), got in runs.items():
        rate = median[arm, precision]
        tokens, wall = got[len(got) // 2]
        each = "/".join(f"{t / w:.0f}" for t, w in got)
        hf, vllm = median.get(("HF", precision)), median.get(("vLLM", precision))
        print(
            f"{arm:<7} {precision:<9} {tokens:>7} {wall:>7.1f} {rate:>7.1f} {each:<22} "
            f"{(f'{rate / hf:.2f}x' if hf else ''):>6} {(f'{rate / vllm:.2f}x' if vllm else ''):>8} "
            f"{rate / ceilings[precision]:>9.0%}",
            flush=True,
        )
        rates[f"{arm} {precision} {n}x{samples} {max_new} new"] = round(rate, 1)
    for precision, ceiling in ceilings.items():
        rates[f"ceiling {precision} {rows} rows"] = round(ceiling, 1)
    return rates


def record(args, rates: dict[str, float]) -> None:
    n, max_new = max(args.prompts), max(args.max_new)
    key = f"{args.samples} {max_new} new"
    rate = rates[f"engine bf16 {n}x{key}"]
    peers = [
        f"{rate / rates[f'{peer} bf16 {n}x{key}']:.2f}x {name} bf16"
        for peer, name in (("vLLM", "vLLM's CPU build"), ("HF", "HF generate"))
        if f"{peer} bf16 {n}x{key}" in rates
    ]
    write_record(
        args.record,
        name="engine-throughput",
        figure=f"engine sampling, bf16: {rate:.0f} tokens/s at {n} prompts x {args.samples}, {max_new} new tokens"
        + (f" ({', '.join(peers)})" if peers else ""),
        unit="tokens/s",
        value=rate,
        values=rates,
        notes=f"Model {args.model}; HumanEval prompts in the chat template, T=1; {args.threads} threads; "
        f"medians of {args.repeats} alternating rounds; every peer at the same precision.",
    )


if __name__ == "__main__":
    main()
