"""Workers as Ray actors (`everybyte cluster --launcher ray --address ADDR`): each actor runs the
same `everybyte serve` process a local launch runs, on the node Ray places it on (SPREAD), bound
to that node's IP on ports free there. The launcher talks to the workers over HTTP as usual; the
actor only starts, watches and stops its process."""
from __future__ import annotations

import os
import subprocess

from everybyte.cluster.launcher import WorkerSpec, free_port, stop_process


def node_address() -> str:
    """The address this node joined the Ray cluster with (`ray start --node-ip-address`), which
    the other nodes reach it on; not whatever interface the machine resolves first."""
    import ray
    node_id = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


class ServeProcess:
    """The actor's body (wrapped by ray.remote in RayWorker)."""

    def __init__(self, host: str | None = None):
        self.host = host or node_address()
        self.proc: subprocess.Popen | None = None

    def start(self, spec: WorkerSpec, extra_env: dict[str, str]) -> tuple[str, int]:
        port = free_port(self.host)
        env = spec.env({**os.environ, **extra_env})
        self.proc = subprocess.Popen(spec.argv(self.host, port, free_port(self.host), free_port(self.host)), env=env)
        return f"http://{self.host}:{port}", self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float) -> int | None:
        return None if self.proc is None else stop_process(self.proc, timeout)


class RayWorker:
    def __init__(self, spec: WorkerSpec, host: str | None = None):
        import ray
        actor_cls = ray.remote(num_cpus=1, scheduling_strategy="SPREAD", max_restarts=0)(ServeProcess)
        self.spec = spec
        self.actor = actor_cls.options(name=None).remote(host)
        # the launcher's PYTHONPATH, so a development tree runs on the actors too
        extra = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
        self.url, self.pid = ray.get(self.actor.start.remote(spec, extra), timeout=300)

    def poll(self) -> int | None:
        import ray
        try:
            return ray.get(self.actor.poll.remote(), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):       # the actor (or its node) is gone
            return -1

    def stop(self, timeout: float) -> int | None:
        import ray
        try:
            return ray.get(self.actor.stop.remote(timeout), timeout=timeout + 30)
        except (ray.exceptions.RayError, TimeoutError):
            return None
        finally:
            ray.kill(self.actor)


def connect(address: str) -> None:
    import ray
    ray.init(address=address, logging_level="WARNING", log_to_driver=False)
