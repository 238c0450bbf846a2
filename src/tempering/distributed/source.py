"""The rollout side of a run: the engine, the environments, the reward and collate - one shard of tasks in,
a scored, collated `Rollout` out. The trainer's process runs one over its own policy (the local backend,
and validation); each Ray rollout worker runs one over its copy of the weights."""

from __future__ import annotations

import torch

from tempering.agent.episodes import sample_episodes
from tempering.config import RunConfig
from tempering.distributed.schedule import ShardSpec
from tempering.envs import env_context
from tempering.inference.engine import SamplingParams, make_engine
from tempering.models.loading import compute_dtype
from tempering.rewards import RewardFunction
from tempering.rollout.batch import Rollout, collate
from tempering.rollout.guidance import guide_failed_groups
from tempering.sandbox import Sandbox
from tempering.tracking import Timer


class RolloutSource:
    def __init__(self, cfg: RunConfig, model, tokenizer, sandbox: Sandbox, version: int = 0):
        self.cfg, self.tokenizer = cfg, tokenizer
        r, lora = cfg.reward, cfg.model.lora
        self.reward_fn = RewardFunction(
            r.weights,
            params=r.params,
            guards=r.guards,
            guard_kinds=r.guard_kinds,
            penalty=r.penalty,
            step_fn=r.step_fn,
            control=r.control,
        )
        self.ctx = env_context(cfg, sandbox, self.reward_fn.needs)
        sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens)
        vllm = (
            {"lora_scaling": lora.alpha / lora.r if lora.r else None} if cfg.rollout.engine == "vllm" else {}
        )
        self.engine = make_engine(
            model,
            tokenizer,
            sampling,
            kind=cfg.rollout.engine,
            version=version,
            dtype=compute_dtype(cfg.model.compute, cfg.run.device),
            **vllm,
        )

    def run(self, spec: ShardSpec) -> Rollout:
        """The shard's episodes (plain records), rewarded and collated; its phase times in `timings`."""
        ro, env, timer = self.cfg.rollout, self.cfg.env, Timer()
        assert spec.version == self.engine.version, (
            f"shard of version {spec.version} on weights {self.engine.version}"
        )
        episodes = sample_episodes(
            self.engine,
            list(spec.tasks),
            self.ctx,
            group_size=ro.group_size,
            max_context=env.max_context,
            chat=env.chat_format,
            timer=timer,
            generator=torch.Generator().manual_seed(spec.generator_seed),
            seed=spec.env_seed,
            first_task=spec.first_task,
        )
        metrics = {}
        if self.cfg.algo.guidance == "reference":
            with timer("guide"):
                episodes, guided = guide_failed_groups(
                    self.engine,
                    episodes,
                    self.ctx,
                    group_size=ro.group_size,
                    max_context=env.max_context,
                    chat=env.chat_format,
                )
            metrics["train/guided_groups"] = float(guided)
        with timer("reward"):
            rewards = self.reward_fn.score(episodes)
        batch = collate(episodes, rewards, self.tokenizer, group_offset=spec.round * ro.prompts_per_step)
        return Rollout(episodes, rewards, batch, metrics, dict(timer.seconds))
