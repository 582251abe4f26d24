"""Ranks, process groups and collectives (torch.distributed) for expert parallelism: imports only
torch and the standard library, so models/ reaches other ranks through here and never a socket."""
from everybyte.dist.group import CollectiveTimeoutError, ProcessGroup, RankDiedError, free_port

__all__ = ["CollectiveTimeoutError", "ProcessGroup", "RankDiedError", "free_port"]
