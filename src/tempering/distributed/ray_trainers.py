"""Data-parallel trainer actors on Ray (`distributed.trainers` = M > 1): this process's trainer is rank 0
(it checkpoints, publishes weights and logs, as with one trainer); ranks 1..M-1 are `TrainerActor`s, each a
replica of the policy (and critic) with its optimizers, started from rank 0's exact state (a resumed run's
included). Every step, rank 0 sends each actor the batch (one `ray.put`), the learning rates and the KL
coefficient; all ranks run `training.update.update_models` over their parts of each minibatch, summing
gradients with gloo (`data_parallel`). Only the update is split: reference log-probs, critic values and
pi_old recomputation stay on rank 0.

Every `distributed.canary_every` steps the actors' weight fingerprints are compared with rank 0's: they must
be the same bits (`canary.compare_replicas`). A trainer actor that dies stops the run with an error that
names it; the run resumes from its last checkpoint (a trainer has no shard to re-send: its step is the run's).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import ray

from tempering.config import RunConfig
from tempering.distributed.canary import compare_replicas
from tempering.distributed.weights import fingerprints
from tempering.errors import TemperingError
from tempering.runtime import configure
from tempering.tracking import Timer
from tempering.training.algorithm import bind_policy_loss
from tempering.training.data_parallel import LOOPBACK, DataParallel, Rendezvous, Replica
from tempering.training.optim import make_optimizer
from tempering.training.update import UpdateSettings, update_models


class TrainerDied(TemperingError):
    """A data-parallel trainer actor died during a step."""


@ray.remote(max_restarts=0)
class TrainerActor:
    """Rank `rank` of the data-parallel trainers: a replica taking the same optimizer steps as rank 0."""

    def __init__(self, cfg_yaml: str, init: list, rank: int):
        import yaml

        cfg = RunConfig.model_validate(yaml.safe_load(cfg_yaml))
        configure(cfg.run.threads)  # Ray sets OMP threads from num_cpus
        algo = cfg.algo
        policy, optimizer_state, critic, critic_optimizer_state = ray.get(init[0])
        self.models = Replica(
            policy,
            make_optimizer(policy, lr=algo.lr, weight_decay=algo.weight_decay),
            critic,
            make_optimizer(critic, lr=algo.critic.lr) if critic is not None else None,
        )
        self.models.optimizer.load_state_dict(optimizer_state)
        if critic is not None:
            self.models.critic_optimizer.load_state_dict(critic_optimizer_state)
        self.cfg, self.rank, self.dp = cfg, rank, None
        self.loss, self.settings = bind_policy_loss(cfg), UpdateSettings.from_config(cfg)

    def join(self, rendezvous: Rendezvous) -> None:
        hostname = LOOPBACK if rendezvous.path else ray.util.get_node_ip_address()
        self.dp = DataParallel(self.rank, rendezvous, device=self.cfg.run.device, hostname=hostname)

    def update(self, step: int, batch: list, lr: list[float], kl_coef: float):
        """One step's update on this rank's parts; -> fingerprints of the policy (and critic) after it."""
        for group, value in zip(self.models.optimizer.param_groups, lr):
            group["lr"] = value
        update_models(
            self.cfg,
            self.models,
            ray.get(batch[0]),
            step,
            loss=self.loss,
            settings=self.settings,
            kl_coef=kl_coef,
            timer=Timer(),
            dp=self.dp,
        )
        critic = self.models.critic
        return fingerprints(self.models.policy), None if critic is None else fingerprints(critic)

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        if self.dp is not None:
            self.dp.close()


class TrainerGroup:
    """Rank 0's side: starts the M-1 actors from this process's state, joins their group, and runs each
    step's update with them."""

    def __init__(self, cfg: RunConfig, state, log=print):
        d = cfg.distributed
        self.cfg, self.size, self.log = cfg, d.trainers, log
        init = ray.put(
            (
                state.policy,
                state.optimizer.state_dict(),
                state.critic,
                None if state.critic is None else state.critic_optimizer.state_dict(),
            )
        )
        gpus = 1 if cfg.run.device.startswith("cuda") else 0
        self.actors = [
            TrainerActor.options(num_cpus=d.trainer_cpus, num_gpus=gpus).remote(cfg.to_yaml(), [init], r)
            for r in range(1, self.size)
        ]
        self.directory, master = None, None
        try:
            ray.get(
                [a.pid.remote() for a in self.actors]
            )  # each has its replica (or its error surfaces here)
            if d.address:  # several nodes may be involved: meet at rank 0's TCP store
                from torch.distributed import TCPStore

                host = ray.util.get_node_ip_address()
                master = TCPStore(host, 0, self.size, True, wait_for_workers=False)
                rendezvous = Rendezvous(self.size, host=host, port=master.port)
            else:  # one machine: a file, and gloo on loopback
                host, self.directory = LOOPBACK, tempfile.mkdtemp(prefix="tempering-dp-")
                rendezvous = Rendezvous(self.size, path=os.path.join(self.directory, "store"))
            joined = [a.join.remote(rendezvous) for a in self.actors]
            self.dp = DataParallel(0, rendezvous, device=cfg.run.device, hostname=host, master=master)
            ray.get(joined)
        except BaseException:
            self.close()
            raise
        self.allreduce_s = 0.0
        log(f"data-parallel trainers: this process and {self.size - 1} trainer actor(s)")

    def update(self, step: int, batch, lr: list[float], kl_coef: float, here, models) -> dict[str, float]:
        """Run `here(dp)` (this process's update of `models`) while every actor runs its own; check that the
        replicas hold rank 0's weights after it."""
        ref = ray.put(batch)
        futures = [a.update.remote(step, [ref], lr, kl_coef) for a in self.actors]
        try:
            metrics = here(self.dp)
            results = ray.get(futures)
        except Exception as e:
            raise self._died(step, futures, e) from e
        d = self.cfg.distributed
        if d.canary_every and step % d.canary_every == 0:
            compare_replicas(fingerprints(models.policy), {r: p for r, (p, _) in enumerate(results, 1)}, step)
            if models.critic is not None:
                compare_replicas(
                    fingerprints(models.critic),
                    {r: c for r, (_, c) in enumerate(results, 1)},
                    step,
                    what="critic",
                )
        seconds, self.allreduce_s = self.dp.seconds - self.allreduce_s, self.dp.seconds
        return metrics | {"dist/trainers": float(self.size), "timing_s/allreduce": seconds}

    def _died(self, step: int, futures, error: BaseException) -> BaseException:
        for rank, future in enumerate(futures, start=1):
            try:
                ray.get(future, timeout=10)
            except ray.exceptions.RayActorError as e:
                return TrainerDied(
                    f"trainer rank {rank} died during step {step} ({type(e).__name__}); the run "
                    "stops here and resumes from its last checkpoint when run again"
                )
            except Exception:  # noqa: BLE001 - not this rank
                continue
        return error

    def close(self) -> None:
        for actor in self.actors:
            try:
                ray.get(actor.close.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - a dead actor has nothing to close
                pass
            ray.kill(actor)
        self.actors = []
        if getattr(self, "dp", None) is not None:
            self.dp.close()
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
