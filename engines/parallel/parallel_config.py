"""Where the ranks of one tensor-parallel replica run and how they find each other."""

from dataclasses import dataclass

from xinserve.engines.platforms import ranks_share_the_device


@dataclass(slots=True)
class ParallelConfig:
    """The ranks of one replica, in rank order over every node: with ``nnodes`` nodes, node k runs
    ranks ``[k * tp / nnodes, (k + 1) * tp / nnodes)``; rank 0 (node 0) hosts the rendezvous."""

    devices: list[str]  # each rank's device ("cpu" may repeat: CPU ranks share the host's cores)
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: any free port (one node only: the others must be told the port)
    rendezvous_timeout_s: float = 120.0  # for every rank to join; then the replica fails with a message
    step_timeout_s: float = 600.0  # for one collective inside a step (a hung, not dead, rank)
    cpu_threads: int | None = None  # torch threads of each CPU rank; None: this process's, shared

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def node_ranks(self, node: int) -> range:
        per_node = self.world_size // self.nnodes
        return range(node * per_node, (node + 1) * per_node)

    def check(self, model: str) -> None:
        """Raise ValueError naming ``model`` for a group that cannot run."""
        kinds = sorted({d.partition(":")[0] for d in self.devices})
        if len(kinds) > 1:
            raise ValueError(f"model {model}: a tensor-parallel group mixes platforms ({', '.join(self.devices)}); "
                             f"all ranks of a replica must be on one device kind")
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(f"model {model}: tensor_parallel_size {self.world_size} does not divide over "
                             f"{self.nnodes} nodes")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError(f"model {model}: a group over {self.nnodes} nodes needs an explicit master port")
        for node in range(self.nnodes):
            local = [self.devices[r] for r in self.node_ranks(node)]
            twice = sorted({d for d in local if not ranks_share_the_device(d) and local.count(d) > 1})
            if twice:
                raise ValueError(f"model {model}: device {', '.join(twice)} is listed twice in one "
                                 f"tensor-parallel group (node {node}); each rank needs its own device")
