"""Data-parallel trainers (`distributed.trainers` = M): M replicas of the policy (and critic) take the same
optimizer steps. Each step's minibatch is cut into M parts, one per rank; each rank's loss is its part's
share of the whole minibatch's loss, so one all-reduce (sum) of the gradients gives every rank the
gradient of the whole minibatch - the local trainer's, up to float summation order - and, since all ranks
then hold the same gradient bits, the same weights after the step (`trainers.TrainerGroup` checks it).

The group is a torch.distributed process group used through its object (no global default group, so a
process can hold several and tests can run ranks as threads): gloo on CPU, NCCL on CUDA. Ranks meet
through a file (one machine; nothing listens on the network but gloo's own loopback sockets) or the
driver's TCP store (several nodes).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import FileStore, TCPStore

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Rendezvous:
    """Where the M ranks meet: `path` (a file every rank can open: one machine), or `host`:`port` (the TCP
    store rank 0 serves: several nodes). `hostname`: the address gloo binds on this machine (loopback for
    one machine)."""

    size: int
    path: str | None = None
    host: str | None = None
    port: int | None = None
    timeout_s: float = 300.0

    def store(self, rank: int, master: TCPStore | None = None):
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.path is not None:
            store = FileStore(self.path, self.size)
            store.set_timeout(timeout)
            return store
        return (
            master
            if rank == 0 and master is not None
            else TCPStore(self.host, self.port, self.size, False, timeout=timeout)
        )


@dataclass
class Replica:
    """What a data-parallel rank trains (the attribute names of `TrainState`, so either goes to
    `training.update.update_models`)."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None


class DataParallel:
    """One rank's view of the group: its part of each minibatch, and the all-reduce of gradients and metrics."""

    def __init__(
        self,
        rank: int,
        rendezvous: Rendezvous,
        *,
        device: str = "cpu",
        hostname: str = LOOPBACK,
        master: TCPStore | None = None,
    ):
        """Blocks until every rank has joined (at most `rendezvous.timeout_s`)."""
        self.rank, self.size = rank, rendezvous.size
        store = rendezvous.store(rank, master)
        if device.startswith("cuda"):
            from torch.distributed import ProcessGroupNCCL

            self.group = ProcessGroupNCCL(store, rank, self.size)
        else:
            from torch.distributed import ProcessGroupGloo

            options = ProcessGroupGloo._Options()
            options._devices = [ProcessGroupGloo.create_device(hostname=hostname)]
            options._timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
            self.group = ProcessGroupGloo(store, rank, self.size, options)
        self.seconds = 0.0
        """Time spent in all-reduces (waiting for the slowest rank included)."""

    def part(self, index: Tensor) -> tuple[Tensor, bool]:
        """This rank's rows of a minibatch (`index`: its rows' positions), and whether they count. A rank whose
        part is empty (fewer rows than ranks) still takes part in the all-reduce: it runs the first row with a
        share of 0, so every rank computes the same metrics and contributes a gradient (of zeros)."""
        mine = torch.tensor_split(index, self.size)[self.rank]
        return (mine, True) if len(mine) else (index[:1], False)

    def allreduce_(self, tensors: list[Tensor]) -> None:
        """Sum `tensors` over the ranks, in place (one flat buffer per dtype)."""
        start = time.perf_counter()
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            self.group.allreduce([flat]).wait()
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        self.seconds += time.perf_counter() - start

    def allreduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of `params` over the ranks (a parameter the forward did not reach counts as 0)."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.allreduce_([p.grad for p in params])

    def allreduce_metrics(self, sums: dict[str, float], keep: tuple[str, ...] = ()) -> dict[str, float]:
        """Sum per-rank metric contributions (each already scaled by the rank's share); keys in `keep` are the
        same on every rank (a gradient norm after the all-reduce) and are left as they are."""
        keys = sorted(k for k in sums if k not in keep)
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        self.allreduce_([values])
        return {**sums, **dict(zip(keys, values.tolist()))}

    def close(self) -> None:
        try:
            self.group.shutdown()
        except Exception:  # noqa: BLE001 - a peer already gone
            pass


def shares(mask: Tensor, index: Tensor, mine: Tensor, counts: bool) -> tuple[float, float]:
    """This rank's share of a minibatch: (of its loss tokens, of its sequences that have one - the seq-mean
    aggregations count only those). `mask`: the batch's loss mask; `index` the minibatch's rows, `mine` this
    rank's; `counts` False for a rank that only takes part (share 0)."""
    if not counts:
        return 0.0, 0.0
    rows = (mask.sum(-1) > 0).float()  # (B,) rows with a token
    token_share = float(mask[mine].sum()) / max(float(mask[index].sum()), 1.0)
    return token_share, float(rows[mine].sum()) / max(float(rows[index].sum()), 1.0)


def unit_share(loss_agg: str, token_share: float, seq_share: float) -> float:
    """The share that scales an aggregated loss: token-mean weighs tokens, the seq-mean aggregations sequences."""
    return token_share if loss_agg == "token-mean" else seq_share
