"""Sampling throughput of the engine against Hugging Face `model.generate` (and vLLM, where its venv exists).

    .venv/bin/python bench/engine_throughput.py [MODEL] [--prompts 2 4] [--max-new 128 256] [--samples 8]
                                               [--vllm .venv-vllm/bin/python] [--threads 2] [--bf16]

HumanEval prompts in the model's chat template (default model: smollm2-135m-instruct), P distinct prompts
x `--samples` samples each, temperature 1.0, full softmax, stopping at the model's stop tokens. Tokens/s
counts the tokens actually generated (up to and including a stop token) over the wall time of the whole
call, prefill included. Every configuration runs each arm in the same process, one after the other.
`--bf16` adds the engine sampling from its bf16 copy (`model.compute: bfloat16`) and HF generate on a bf16
copy of the model; ratios are against HF generate in fp32.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time

import torch
from record import write_record  # bench/record.py, beside this script

from tempering.checkpoint import resolve_model
from tempering.data.benchmarks import humaneval_tasks
from tempering.inference.chat import chat_format
from tempering.inference.engine import LocalEngine, SamplingParams, make_engine
from tempering.models.loading import load_model, load_tokenizer

VLLM_ARM = r"""
import json, sys, time
from vllm import LLM, SamplingParams, TokensPrompt
model, prompts, samples, max_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model=model, dtype="float32", gpu_memory_utilization=0.2, max_model_len=2048, seed=0)
params = SamplingParams(n=samples, temperature=1.0, top_p=1.0, max_tokens=max_new)
llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:1]], params)  # warm-up
started = time.perf_counter()
out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
wall = time.perf_counter() - started
print(json.dumps({"tokens": sum(len(c.token_ids) for o in out for c in o.outputs), "wall": wall}))
"""


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
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts for _ in range(samples)])
    mask = (
        torch.arange(width)[None]
        >= torch.tensor([width - len(p) for p in prompts for _ in range(samples)])[:, None]
    )
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
    ended = torch.isin(new, torch.tensor(stops))
    after = (ended.cumsum(1) - ended.long()) > 0  # tokens after the first stop are padding
    return int((~after).sum()), wall


def vllm_arm(
    python: str, model_dir: str, prompts: list[list[int]], samples: int, max_new: int, threads: int
) -> tuple[int, float] | None:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(
        [python, "-c", VLLM_ARM, model_dir, json.dumps(prompts), str(samples), str(max_new)],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"vllm arm failed: {done.stderr.strip()[-400:]}", file=sys.stderr)
        return None
    result = json.loads(lines[-1])
    return result["tokens"], result["wall"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, nargs="+", default=[2, 4])
    p.add_argument("--max-new", type=int, nargs="+", default=[128, 256])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm", help="python of a venv with vllm-cpu (make vllm): adds the vLLM arm")
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate arm")
    p.add_argument("--bf16", action="store_true", help="add the bf16 arms (engine and HF generate)")
    p.add_argument(
        "--record", metavar="PATH", help="also write the largest arm's engine figure as a result record"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    model, tokenizer = load_model(model_dir).eval(), load_tokenizer(model_dir)
    fmt = chat_format(tokenizer, "auto")
    tasks = humaneval_tasks()
    engine = make_engine(model, tokenizer)
    stops, pad = list(engine.stop_ids), tokenizer.pad_token_id
    engine_arm(engine, [fmt.start(tasks[-1].prompt)[0]], 2, 8)  # warm-up
    if args.bf16:
        engine16, model16 = (
            make_engine(model, tokenizer, dtype=torch.bfloat16),
            copy.deepcopy(model).bfloat16(),
        )
        engine_arm(engine16, [fmt.start(tasks[-1].prompt)[0]], 2, 8)
    print(f"{'P':>2} {'max_new':>7} {'arm':<8} {'tokens':>7} {'wall s':>7} {'tok/s':>7} {'vs HF':>6}")
    rates: dict[str, float] = {}
    for max_new in args.max_new:
        for n in args.prompts:
            prompts = [fmt.start(t.prompt)[0] for t in tasks[:n]]
            rows = {"engine": engine_arm(engine, prompts, args.samples, max_new)}
            if not args.no_hf:
                rows["HF"] = hf_arm(model, prompts, args.samples, max_new, stops, pad)
            if args.bf16:
                rows["engine16"] = engine_arm(engine16, prompts, args.samples, max_new)
                if not args.no_hf:
                    rows["HF16"] = hf_arm(model16, prompts, args.samples, max_new, stops, pad)
            if args.vllm:
                got = vllm_arm(args.vllm, str(model_dir), prompts, args.samples, max_new, args.threads)
                if got:
                    rows["vLLM"] = got
            hf = rows["HF"][0] / rows["HF"][1] if "HF" in rows else None
            for arm, (tokens, wall) in rows.items():
                rate = tokens / wall
                rates[f"{arm} {n}x{args.samples} {max_new} new"] = round(rate, 1)
                print(
                    f"{n:>2} {max_new:>7} {arm:<8} {tokens:>7} {wall:>7.1f} {rate:>7.1f} "
                    + (f"{rate / hf:>5.2f}x" if hf else ""),
                    flush=True,
                )
    if args.record:
        n, max_new = max(args.prompts), max(args.max_new)
        arm = "engine16" if args.bf16 else "engine"
        rate = rates[f"{arm} {n}x{args.samples} {max_new} new"]
        hf = rates.get(f"HF {n}x{args.samples} {max_new} new")
        write_record(
            args.record,
            name="engine-throughput",
            figure=f"engine sampling, {'bf16' if args.bf16 else 'fp32'}: {rate:.0f} tokens/s at {n} prompts x "
            f"{args.samples}, {max_new} new tokens" + (f" ({rate / hf:.2f}x HF generate fp32)" if hf else ""),
            unit="tokens/s",
            value=rate,
            values=rates,
            notes=f"Model {args.model}; HumanEval prompts in the chat template, T=1; {args.threads} threads.",
        )


if __name__ == "__main__":
    main()
