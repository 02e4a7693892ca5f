"""SGLang servers on server hosts, which may be on other nodes (`rollout.sglang_gpus_per_host`). A server host is a
Ray actor holding GPUs of one node: it starts its servers there, listening on the node's address, and does what needs
the node: their processes' lifetime and logs, and the requests that hand SGLang a tensor or a file (checksums, the
deep verification). The rollout engine (sglang.py) sees each server as a RemoteServer: HTTP straight to the server
for generation and weight updates, the rest through the host.

Weights reach such a server over NCCL from the sending training rank (transports/nccl_broadcast.py), which
rendezvouses at that rank's address: nothing goes through the hosts or the rollout actor.
"""

from __future__ import annotations

from typing import Callable

from megarl.rollout.sglang_server import Endpoint, SGLangError, SGLangServer, sglang_server

# what a RemoteServer asks its host to do with the server of that index (ServerHost.call)
HOST_CALLS = ("start", "restart", "died", "diagnose", "log_tail", "shutdown", "inspect", "weight_checksums", "verify")


class HostGone(SGLangError):
    """A server host's actor died (its node went, or it was killed): its servers ended with it."""


class ServerHost:
    """The SGLang servers of one node, on the GPUs Ray gave this actor (megarl.workers.group.start_server_hosts: a
    threaded actor, so that its servers start side by side). `factory`: sglang_server, or a stand-in of it (tests)."""

    def __init__(self, factory: Callable[..., SGLangServer] = sglang_server):
        import ray

        self.factory, self.gpus = factory, [str(g) for g in ray.get_gpu_ids()]
        self.address = ray.util.get_node_ip_address()
        self.servers: list[SGLangServer] = []

    def where(self, gpus: list[str] | None = None) -> str:
        """Its node and the GPUs its servers go on (default its own), for the start-up line."""
        import ray

        node = ray.get_runtime_context().get_node_id()[:8]
        return f"node {self.address} ({node}) GPUs {','.join(gpus or self.gpus)}"

    def launch(self, model_path: str, count: int, tp: int, server_kwargs: dict,
               gpus: list[str] | None = None) -> tuple[str, list[tuple[str, int, float]]]:
        """`count` servers of `tp` GPUs each (not started), server i on GPUs [i * tp, (i + 1) * tp) of `gpus` (GPU ids
        of this node: colocated, the training ranks'; default this actor's own), listening on the node's address.
        Returns the node's Ray id and each server's URL, TP size and request timeout."""
        import ray

        gpus = gpus or self.gpus
        if gpus and len(gpus) < count * tp:
            raise SGLangError(f"a server host serves on {len(gpus)} GPU(s); {count} server(s) of TP {tp} need "
                              f"{count * tp}")
        self.servers = [self.factory(model_path, tp=tp, gpu=i * tp, visible_devices=gpus or None,
                                     host=self.address, **server_kwargs) for i in range(count)]
        for server in self.servers:  # the run's output directory may be on another node's disk only
            server.log_path.parent.mkdir(parents=True, exist_ok=True)
        return ray.get_runtime_context().get_node_id(), [(s.url, s.tp, s.request_timeout) for s in self.servers]

    def call(self, index: int, name: str, *args):
        """Server `index`'s method `name` (one of HOST_CALLS); start and restart answer the new process's id."""
        if name not in HOST_CALLS:
            raise ValueError(f"a server host does not call {name!r}: expected one of {', '.join(HOST_CALLS)}")
        server = self.servers[index]
        result = getattr(server, name)(*args)
        return server.process.pid if name in ("start", "restart") else result


class RemoteServer(Endpoint):
    """The rollout engine's handle on server `index` of a server host (the SGLangServer interface sglang.py uses).
    alive() answers from what is known here, without a round trip (routing asks it for every prompt): a server is
    alive until a failed request's died() (which asks the host) finds it dead, and again once restarted."""

    remote = True  # its `node` is its host's

    def __init__(self, host, index: int, url: str, tp: int, request_timeout: float, node: str = ""):
        super().__init__(url, tp, request_timeout)
        self.host, self.index, self.node = host, index, node  # node: its host's Ray node id
        self.pid: int | None = None
        self.known_alive = False

    def _call(self, name: str, *args, timeout: float | None = None):
        import ray

        try:
            return ray.get(self.host.call.remote(self.index, name, *args), timeout=timeout)
        except ray.exceptions.GetTimeoutError as error:
            raise SGLangError(f"{name} of server {self.url}: its host did not answer within {timeout:.0f} s") from error
        except ray.exceptions.RayActorError as error:
            self.known_alive = False
            raise HostGone(f"{name} of server {self.url}: its server host is gone ({error})") from error

    def endpoint(self, transport: str = "cuda_ipc") -> Endpoint:
        return Endpoint(self.url, self.tp, self.request_timeout, transport, self.pid)

    def start(self) -> "RemoteServer":
        self.pid, self.known_alive = self._call("start"), True
        return self

    def restart(self) -> "RemoteServer":
        self.pid, self.known_alive = self._call("restart"), True
        return self

    def alive(self) -> bool:
        return self.known_alive

    def died(self, grace: float = 10.0) -> bool:
        try:
            self.known_alive = not self._call("died", grace, timeout=grace + 60)
        except HostGone:  # known_alive is False: the host's servers end with it (server_guard.py)
            pass
        return not self.known_alive

    def diagnose(self, grace: float = 0.0) -> str:
        try:
            return self._call("diagnose", grace, timeout=grace + 60)
        except SGLangError as error:
            return f" ({error})"

    def log_tail(self, lines: int = 30) -> str:
        return self._call("log_tail", lines, timeout=60)

    def shutdown(self) -> None:
        try:
            self._call("shutdown", timeout=120)
        except HostGone:  # its servers' guards ended them with it
            pass
        self.known_alive = False

    def inspect(self, headers: list[dict], serialize: Callable | None = None) -> None:
        self._call("inspect", headers, serialize)

    def weight_checksums(self, serialize: Callable | None = None) -> dict[int, dict[str, list]]:
        return self._call("weight_checksums", serialize)

    def verify(self, received: dict, model_path: str, directory: str) -> None:
        self._call("verify", received, model_path, directory)


def remote_servers(hosts: list[tuple[object, int, list[str] | None]], model_path: str, tp: int,
                   server_kwargs: dict) -> list[RemoteServer]:
    """The servers of `hosts` ((ServerHost actor, its number of servers, the GPUs they go on or None for the host's
    own) each), host by host, launched there with `server_kwargs` (sglang_server's); not started."""
    import ray

    described = ray.get([host.launch.remote(model_path, count, tp, server_kwargs, gpus) for host, count, gpus in hosts])
    return [RemoteServer(host, i, url, server_tp, timeout, node)
            for (host, _, _), (node, servers) in zip(hosts, described)
            for i, (url, server_tp, timeout) in enumerate(servers)]
