"""The communication of one tensor-parallel group, in one place: the collectives the sharded layers
call (all-reduce, the gather of the logits), the per-step broadcast of the step's inputs, and the
rendezvous that forms the group. A device kernel (a fused all-reduce + RMSNorm, say) replaces a
method here, not the layers.

Two process groups over the same ranks: the *device group* (the platform's backend: gloo on CPU,
nccl, hccl, mccl) carries the all-reduces and the gather inside a step, with the step timeout; the
*control group* (always gloo, on the host) carries rank 0's step message, with no practical timeout,
since a follower waits on it for as long as the server is idle. A rank that dies closes its
sockets, so the others' pending collective fails at once instead of waiting for a timeout.

``counts`` tallies every collective by name (benchmarks/parallel_collectives.py reads it per step).
"""

import logging
import time
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# int64 elements of the first broadcast of a step: a decode step of a modest batch fits in it, a
# larger step sends the rest in a second broadcast (the first says how long the message is).
FIRST_BROADCAST = 4096
IDLE_TIMEOUT = timedelta(days=365)  # a follower waits for the next step as long as the server idles


JOINED_KEY = "xinserve/joined"


def open_store(rank: int, world_size: int, master_addr: str, master_port: int,
               rendezvous_timeout_s: float) -> dist.TCPStore:
    """Rank 0 hosts the rendezvous store (``master_port`` 0: any free port, read back from
    ``store.port``); the other ranks connect to it, retrying until ``rendezvous_timeout_s``."""
    try:
        return dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                             timeout=timedelta(seconds=rendezvous_timeout_s), wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(
            f"rank {rank} of a tensor-parallel group of {world_size}: cannot reach the rendezvous at "
            f"{master_addr}:{master_port} within {rendezvous_timeout_s:g}s ({type(exc).__name__}: {exc}); "
            f"check that the head node runs and every node has the same --master-addr/--master-port"
        ) from None


def _wait_for_ranks(store: dist.TCPStore, world_size: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (joined := store.add(JOINED_KEY, 0)) < world_size - 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {joined} of the {world_size - 1} other ranks joined")
        time.sleep(0.05)


class GroupFailure(BaseException):
    """A rank of the group is gone or unreachable: the replica cannot compute any more.

    A BaseException, so that the engine's per-request error handling (``except Exception``) does not
    treat it as one request's failure: the process must end and its supervisor restart the group.
    """


class ParallelGroup:
    """This process's membership in one tensor-parallel group of ``world_size`` ranks."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device,
        store: dist.TCPStore,
        rendezvous_timeout_s: float,
        step_timeout_s: float,
    ) -> None:
        """Join the group through ``store`` (``open_store``): rank 0 waits up to ``rendezvous_timeout_s``
        for every other rank to check in, then all connect their backends."""
        self.rank, self.world_size, self.device, self.store = rank, world_size, device, store
        self.counts: Counter[str] = Counter()
        where = f"{store.host}:{store.port}"
        try:
            if rank == 0:
                _wait_for_ranks(store, world_size, rendezvous_timeout_s)
            else:
                store.add(JOINED_KEY, 1)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=step_timeout_s))
            self.device_group = dist.group.WORLD
            self.control_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        except Exception as exc:  # noqa: BLE001  the store and the backends raise several types
            if dist.is_initialized():
                dist.destroy_process_group()
            raise RuntimeError(
                f"rank {rank} of a tensor-parallel group of {world_size}: the group did not assemble at "
                f"{where} within {rendezvous_timeout_s:g}s ({type(exc).__name__}: {exc}); check that every "
                f"node was started with the same --master-addr/--master-port and can reach {where}"
            ) from None

    # ---- collectives inside a step (device group) ----

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        self.counts["all_reduce"] += 1
        self._checked(dist.all_reduce, x, group=self.device_group)
        return x

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Each rank's [N, V / tp] vocabulary slice -> [N, vocab_size] on rank 0 (the padding of the
        last slice dropped); the other ranks get their own slice back, which they do not use."""
        self.counts["gather"] += 1
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.world_size)] if self.rank == 0 else None
        self._checked(dist.gather, logits, parts, dst=0, group=self.device_group)
        return torch.cat(parts, dim=-1)[:, :vocab_size] if parts is not None else logits

    def all_to_all(self, output: torch.Tensor, x: torch.Tensor, output_splits: list[int],
                   input_splits: list[int]) -> torch.Tensor:
        """Rows ``input_splits[r]`` of ``x`` (in rank order) to rank r; ``output`` receives
        ``output_splits[r]`` rows from rank r (expert parallel's dispatch and combine); returns it."""
        self.counts["all_to_all"] += 1
        self._checked(dist.all_to_all_single, output, x.contiguous(), output_splits, input_splits,
                      group=self.device_group)
        return output

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape on all), in rank order."""
        self.counts["all_gather"] += 1
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._checked(dist.all_gather, parts, x.contiguous(), group=self.device_group)
        return parts

    def min_over_ranks(self, value: int) -> int:
        self.counts["all_reduce"] += 1
        t = torch.tensor([value], dtype=torch.int64)
        self._checked(dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    # ---- the step message (control group) ----

    def broadcast_message(self, message: torch.Tensor | None) -> torch.Tensor:
        """Rank 0 passes a 1-D int64 host tensor, the others None; every rank returns the message.
        One broadcast of ``FIRST_BROADCAST`` elements, a second only for a longer message."""
        first = torch.zeros(FIRST_BROADCAST, dtype=torch.int64)
        if message is not None:
            first[0] = len(message)
            head = message[: FIRST_BROADCAST - 1]
            first[1 : 1 + len(head)] = head
        self.counts["broadcast"] += 1
        self._checked(dist.broadcast, first, src=0, group=self.control_group)
        length = int(first[0])
        if length <= FIRST_BROADCAST - 1:
            return first[1 : 1 + length]
        rest = message[FIRST_BROADCAST - 1 :].contiguous() if message is not None else torch.empty(
            length - (FIRST_BROADCAST - 1), dtype=torch.int64)
        self.counts["broadcast"] += 1
        self._checked(dist.broadcast, rest, src=0, group=self.control_group)
        return torch.cat([first[1:], rest])

    def _checked(self, collective, /, *args, **kwargs) -> None:
        try:
            collective(*args, **kwargs)
        except RuntimeError as exc:  # gloo / nccl report a lost peer or a timeout this way
            raise GroupFailure(f"rank {self.rank}: a collective of the tensor-parallel group failed "
                               f"(a rank died or timed out): {exc}") from exc

    def close(self) -> None:
        """Leave the group once: destroy this process's process groups and drop the rendezvous store
        (rank 0's closes its port), so that a later group can form in this process."""
        if self.store is None:
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = self.device_group = self.control_group = None
