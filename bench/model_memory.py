"""Peak memory and time of one policy update of a real model: LoRA vs full fine-tuning, float32 vs bfloat16,
gradient checkpointing on and off - the same batch for every arm; and, with `--curve`, peak memory and
update time against response length (LoRA, float32, checkpointing on and off).

    .venv/bin/python bench/model_memory.py [--model smollm2-135m-instruct] [--rows 8] [--prompt 256] [--response 128]
    .venv/bin/python bench/model_memory.py --curve [--lengths 256 512 1024 2048 4096 7936] [--rows 4]

The curve's rows share one prompt (a group), so the update packs them into one sequence while it fits
(`models.forward.PACK`) and runs them one by one beyond; log-probs and entropy are computed in chunks.

Each arm runs in its own process (peak resident memory only grows; malloc tuned as the `tempering` command
tunes it, `runtime.fixed_mmap_threshold`), loads the model, does one warm-up
update and `--repeats` timed ones (PPO-clip, 2 minibatches, random advantages), and reports the mean
update time, trained tokens per second and the process's peak resident memory. Printed as a table, with
ratios against full fine-tuning in float32.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

ARMS = [
    ("full", "float32", False),
    ("lora", "float32", False),
    ("full", "bfloat16", False),
    ("lora", "bfloat16", False),
    ("full", "float32", True),
    ("lora", "float32", True),
]


def run_arm(args: argparse.Namespace) -> dict:
    import torch

    from tempering.algos import POLICY_LOSSES
    from tempering.models.loading import load_model
    from tempering.models.lora import add_adapters
    from tempering.models.registry import prepare
    from tempering.rollout.batch import RolloutBatch
    from tempering.training.optim import make_optimizer
    from tempering.training.update import UpdateSettings, update_policy

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    path = prepare(args.model, log=lambda *_: None)
    model = load_model(path, dtype=args.dtype)
    if args.mode == "lora":
        model = add_adapters(model, path, r=16, alpha=32, dropout=0.0, target_modules="all-linear")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    b, p, r, vocab = args.rows, args.prompt, args.response, model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, p)).expand(b, p) if args.shared else torch.randint(0, vocab, (b, p))
    batch = RolloutBatch(
        prompt_ids=prompt.contiguous(),
        prompt_mask=torch.ones(b, p, dtype=torch.long),
        response_ids=torch.randint(0, vocab, (b, r)),
        response_mask=torch.ones(b, r),
        old_logprobs=torch.full((b, r), -2.0),
        rewards=torch.randn(b),
        group_ids=torch.arange(b) // 4,
    )
    batch.advantages = torch.randn(b, 1).expand(b, r).contiguous()
    optimizer = make_optimizer(model, lr=1e-5)
    times = []
    for i in range(args.repeats + 1):
        start = time.perf_counter()
        settings = UpdateSettings(minibatches=args.minibatches, gradient_checkpointing=args.checkpointing)
        update_policy(
            model, optimizer, batch, POLICY_LOSSES["ppo_clip"], settings, torch.Generator().manual_seed(i)
        )
        times.append(time.perf_counter() - start)
    seconds = sum(times[1:]) / args.repeats
    return {
        "mode": args.mode,
        "dtype": args.dtype,
        "checkpointing": args.checkpointing,
        "trainable": trainable,
        "response": r,
        "update_s": seconds,
        "tokens_per_s": b * r / seconds,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--minibatches", type=int, default=2)
    parser.add_argument("--curve", action="store_true", help="peak memory and time against response length")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 7936])
    parser.add_argument("--shared", action="store_true", help=argparse.SUPPRESS)  # the rows share one prompt
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # mode,dtype,checkpointing: run one arm, print JSON
    args = parser.parse_args()
    if args.arm:
        from tempering.runtime import fixed_mmap_threshold

        fixed_mmap_threshold()  # as `tempering` runs: freed large tensors go back to the system
        mode, dtype, ckpt = args.arm.split(",")
        args.mode, args.dtype, args.checkpointing = mode, dtype, ckpt == "1"
        print(json.dumps(run_arm(args)))
        return
    if args.curve:
        curve(args)
        return
    rows = []
    for mode, dtype, ckpt in ARMS:
        cmd = [
            sys.executable,
            __file__,
            f"--arm={mode},{dtype},{int(ckpt)}",
            f"--model={args.model}",
            f"--rows={args.rows}",
            f"--prompt={args.prompt}",
            f"--response={args.response}",
            f"--repeats={args.repeats}",
            f"--threads={args.threads}",
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        rows.append(json.loads(out))
    base = rows[0]
    print(
        f"{args.model}: one update of {args.rows} rows x ({args.prompt} prompt + {args.response} response) "
        f"tokens, 2 minibatches, {args.threads} threads"
    )
    print(
        f"{'mode':<5} {'dtype':<9} {'ckpt':<4} {'trainable':>11} {'update s':>9} {'tok/s':>7} {'peak GB':>8} "
        f"{'time x':>7} {'mem x':>6}"
    )
    for r in rows:
        print(
            f"{r['mode']:<5} {r['dtype']:<9} {'on' if r['checkpointing'] else 'off':<4} {r['trainable']:>11,} "
            f"{r['update_s']:>9.2f} {r['tokens_per_s']:>7.1f} {r['peak_rss_gb']:>8.2f} "
            f"{r['update_s'] / base['update_s']:>7.2f} {r['peak_rss_gb'] / base['peak_rss_gb']:>6.2f}"
        )


def curve(args: argparse.Namespace) -> None:
    print(
        f"{args.model} + LoRA r=16, float32: one update of {args.rows} rows sharing a {args.prompt}-token prompt, "
        f"1 minibatch, {args.threads} threads"
    )
    print(f"{'response':>8} {'ckpt':<4} {'update s':>9} {'tok/s':>7} {'peak GB':>8}")
    for length in args.lengths:
        # Without checkpointing every layer's activations are kept: past 2k tokens a row that is more than this
        # machine's memory (24 GB), so those points are not run.
        for ckpt in (True, False) if length <= 2048 else (True,):
            cmd = [
                sys.executable,
                __file__,
                f"--arm=lora,float32,{int(ckpt)}",
                f"--model={args.model}",
                "--shared",
                f"--rows={args.rows}",
                f"--prompt={args.prompt}",
                f"--response={length}",
                "--minibatches=1",
                "--repeats=1",
                f"--threads={args.threads}",
            ]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(
                    f"{length:>8} {'on' if ckpt else 'off':<4} failed: {done.stderr.strip()[-200:]}",
                    flush=True,
                )
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(
                f"{length:>8} {'on' if ckpt else 'off':<4} {r['update_s']:>9.1f} {r['tokens_per_s']:>7.1f} "
                f"{r['peak_rss_gb']:>8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
