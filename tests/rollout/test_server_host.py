"""SGLang servers on server hosts (rollout.sglang_gpus_per_host: Ray actors that each hold one node's share of the
server GPUs). The servers are fake_sglang.py processes: through the real launch path (`python -m
sglang.launch_server`, a stand-in package) for the rollout actor's placement, and through a stand-in factory for the
engine's calls that need the server's node (checksums, a restart)."""

from __future__ import annotations

import functools
import time
import os
import signal
import tempfile
import textwrap
from pathlib import Path

import pytest
import requests

from megarl.config.tiny import tiny_config
from megarl.rollout.base import SamplingParams
from megarl.rollout.transports import cuda_ipc
from megarl.workers.weight_sync import PolicySync, RolloutSide
from tests.rollout import fake_sglang
from tests.rollout.test_server_shutdown import FAKE, REPO, process_alive, servers_of, wait_gone
from tests.rollout.test_sglang_engine import bucket_of, fake_server, log


@pytest.fixture(scope="module")
def ray_two_gpus(tmp_path_factory):
    """A local Ray cluster of three nodes, two of them with one (logical) GPU, whose workers find
    `sglang.launch_server` = fake_sglang.py."""
    import ray

    shim = tmp_path_factory.mktemp("shim")
    (shim / "sglang").mkdir()
    (shim / "sglang" / "__init__.py").write_text("")
    (shim / "sglang" / "launch_server.py").write_text(textwrap.dedent(f"""
        import runpy, sys
        port, host = (sys.argv[sys.argv.index(flag) + 1] for flag in ("--port", "--host"))
        sys.argv = [{str(FAKE)!r}, "--port", port, "--host", host]
        runpy.run_path({str(FAKE)!r}, run_name="__main__")
        """))
    path = os.pathsep.join([str(shim), str(REPO), os.environ.get("PYTHONPATH", "")])
    from ray.cluster_utils import Cluster

    # a head node for the driver's actors and two nodes of one (logical) GPU each, for the server hosts
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1, num_gpus=1)
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": path}})
    yield
    ray.shutdown()
    cluster.shutdown()


def fake_factory(model_path, tp, gpu, visible_devices, host, **kwargs):
    """sglang_server's stand-in inside a server host: a fake server of its own."""
    return fake_server(Path(tempfile.gettempdir()), request_timeout=30)


def test_rollout_actor_places_its_servers_on_hosts_and_stops_them(ray_two_gpus, tmp_path, capsys):
    """rollout.sglang_gpus=2 with rollout.sglang_gpus_per_host=1: two hosts of one GPU each start one server each
    (the real launch command, listening on the node's address, under each host's guard), the rollout actor holds no
    GPU and generates through both; stop_rollout ends the servers and the hosts."""
    import ray

    from megarl.workers.group import start_rollout, stop_rollout

    model = tmp_path / "model-on-hosts"  # unique: marks these servers in /proc
    model.mkdir()
    (tmp_path / "out").mkdir()
    cfg = tiny_config(["rollout.engine=sglang", "rollout.sglang_gpus=2", "rollout.sglang_gpus_per_host=1",
                             f"trainer.output_dir={tmp_path / 'out'}", "trainer.verify_weight_sync_every=0"])
    actor = start_rollout(cfg, str(model), "cpu")
    try:
        out = ray.get(actor.generate.remote([[1, 2, 3]] * 4, SamplingParams(max_new_tokens=5, n=2)), timeout=120)
        assert len(out) == 8 and all(len(g.token_ids) == 5 for g in out)
        pairs = servers_of(str(model))
        assert len(pairs) == 2
        address = ray.util.get_node_ip_address()
        hosts = set()
        for guard, server in pairs:
            command = Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")
            assert command[command.index(b"--host") + 1].decode() == address
            hosts.add(int(Path(f"/proc/{guard}/cmdline").read_bytes().split(b"\0")[2]))  # the guard's owner
        assert len(hosts) == 2  # each server under its own host: neither is the rollout actor's child
        assert ray.available_resources().get("GPU", 0) == 0  # the hosts hold both GPUs; the rollout actor none
        (line,) = [x for x in capsys.readouterr().out.splitlines() if "server host" in x]
        assert line.startswith("megarl: 2 SGLang server host(s) of 1 server(s): node ")
        for node in (n["NodeID"] for n in ray.nodes() if n["Resources"].get("GPU")):  # one host on each GPU node
            assert line.count(f"({node[:8]})") == 1
    finally:
        stop_rollout(actor)
    assert wait_gone([pid for pair in pairs for pid in pair], 30) == []
    assert wait_gone(list(hosts), 30) == []


def test_engine_on_hosts_syncs_checks_and_restarts_remote_servers(ray_two_gpus, tmp_path):
    """The engine's calls on servers of two hosts: weights broadcast to both (gloo in place of NCCL) arrive bit for
    bit; their checksums, taken on each server's node, name a bit flipped in one; a server that dies mid-generate is
    restarted by its host and the request goes to the one that holds the current policy."""
    import ray

    from megarl.rollout.server_host import ServerHost
    from megarl.rollout.sglang import SGLangRolloutEngine

    hosts = [ray.remote(ServerHost).options(num_cpus=0, max_concurrency=4).remote(fake_factory) for _ in range(2)]
    e = SGLangRolloutEngine("unused", colocated=False, hosts=[(h, 1, None) for h in hosts],
                            serializer=cuda_ipc.plain_serializer)
    try:
        syncs, bucket = PolicySync("persistent"), bucket_of(7)
        not_here = functools.partial(pytest.fail, "a direct sync must not load buckets through the rollout actor")
        report = syncs.push(iter([bucket]), RolloutSide(e.begin_weight_update, e.end_weight_update, not_here))
        assert report.direct and e.version == 1
        expected = {n: fake_sglang.digest(t) for n, t in bucket}
        for server in e.servers:
            assert requests.get(server.url + "/fake/weights", timeout=5).json() == expected
        held = e.weight_checksums()
        assert set(held) == {0, 1} and held[0] == held[1] and set(held[0][0]) >= {n for n, _ in bucket}
        e.corrupt_weight("model.norm.weight", server=1)
        after = e.weight_checksums()
        assert after[0] == held[0] and after[1][0]["model.norm.weight"] != held[1][0]["model.norm.weight"]

        first_pid = e.servers[1].pid
        os.killpg(first_pid, signal.SIGKILL)  # the guard and its server die; their host stays
        out = e.generate([[1, 2]] * 4, SamplingParams(max_new_tokens=3, n=1))
        assert len(out) == 4 and e.restarts == 1 and e.servers[1].pid != first_pid and e.servers[1].alive()
        assert len(log(e.servers[0], "/generate")) >= 1
        syncs.close()
    finally:
        e.shutdown()
    assert not any(process_alive(s.pid) for s in e.servers)
    for host in hosts:
        ray.kill(host)


def test_colocated_servers_across_nodes_go_on_each_nodes_training_gpus(ray_two_gpus, tmp_path, capsys):
    """Training ranks on two nodes, colocated servers: a server host pinned to each node starts its servers on that
    node's training GPUs; with full delivery the servers of rank 0's node take the weights by CUDA IPC, the others by
    NCCL; with sharded delivery every server by CUDA IPC, from the training ranks on its GPUs. A generation TP that
    would span nodes is refused."""
    import ray

    from megarl.workers.group import start_rollout, stop_rollout

    model = tmp_path / "model-colocated-hosts"
    model.mkdir()
    (tmp_path / "out").mkdir()
    overrides = ["rollout.engine=sglang", f"trainer.output_dir={tmp_path / 'out'}", "trainer.verify_weight_sync_every=0"]
    nodes = [n["NodeID"] for n in ray.nodes() if n["Resources"].get("GPU")]
    training = [(nodes[1], ["0"]), (nodes[0], ["0"])]  # rank 0 on the second GPU node
    with pytest.raises(RuntimeError, match="a colocated server cannot span nodes"):
        start_rollout(tiny_config(overrides + ["rollout.sglang_tp=2"]), str(model), "cpu", training)
    sharded = start_rollout(tiny_config(overrides + ["rollout.weight_delivery=sharded"]), str(model), "cpu",
                            training)
    try:
        endpoints = ray.get(sharded.begin_weight_update.remote(), timeout=60)
        assert [e.transport for e in endpoints] == ["cuda_ipc", "cuda_ipc"]
        ray.get(sharded.end_weight_update.remote(None), timeout=60)
    finally:
        stop_rollout(sharded)
    capsys.readouterr()
    actor = start_rollout(tiny_config(overrides), str(model), "cpu", training)
    try:
        out = ray.get(actor.generate.remote([[1, 2, 3]] * 4, SamplingParams(max_new_tokens=5, n=2)), timeout=120)
        assert len(out) == 8
        (line,) = [x for x in capsys.readouterr().out.splitlines() if "colocated SGLang servers" in x]
        assert line.index(f"({nodes[1][:8]}) GPUs 0") < line.index(f"({nodes[0][:8]}) GPUs 0")
        pairs = servers_of(str(model))
        assert len(pairs) == 2
        for _, server in pairs:  # on the node's training GPU
            assert b"\0CUDA_VISIBLE_DEVICES=0\0" in Path(f"/proc/{server}/environ").read_bytes()
        endpoints = ray.get(actor.begin_weight_update.remote(), timeout=60)
        assert [e.transport for e in endpoints] == ["cuda_ipc", "nccl"]  # rank 0's node's server first
        ray.get(actor.end_weight_update.remote(None), timeout=60)
    finally:
        stop_rollout(actor)
    assert wait_gone([pid for pair in pairs for pid in pair], 30) == []


def test_split_sender_reaches_local_servers_by_ipc_and_the_others_by_broadcast(tmp_path):
    """One sync into a colocated server of the sender's node (CUDA IPC; pickled tensors on CPU) and a server of
    another node (NCCL broadcast; gloo on CPU): both hold the bucket bit for bit, and the sender is one of each."""
    from megarl.rollout.sglang import SGLangRolloutEngine
    from megarl.workers.weight_senders import SplitSender

    e = SGLangRolloutEngine("unused", num_servers=2, colocated=True,
                            launch=lambda i: fake_server(tmp_path, request_timeout=30))
    e.transports = ["cuda_ipc", "nccl"]  # what a second node's host gives the second server
    try:
        syncs, bucket = PolicySync("persistent", serializer=cuda_ipc.plain_serializer), bucket_of(5)
        not_here = functools.partial(pytest.fail, "a direct sync must not load buckets through the rollout actor")
        syncs.push(iter([bucket]), RolloutSide(e.begin_weight_update, e.end_weight_update, not_here))
        (sender,) = syncs.senders.values()
        assert isinstance(sender, SplitSender)
        expected = {n: fake_sglang.digest(t) for n, t in bucket}
        for server in e.servers:
            assert requests.get(server.url + "/fake/weights", timeout=5).json() == expected
        assert len(log(e.servers[0], "/update_weights_from_tensor")) == 1
        assert len(log(e.servers[1], "/update_weights_from_distributed")) == 1
        syncs.close()
    finally:
        e.shutdown()


def test_server_hosts_are_refused_when_the_nodes_cannot_hold_them(monkeypatch, tmp_path):
    from megarl.config.validation import ConfigError
    from megarl.workers import group

    monkeypatch.setattr(group.ray, "nodes", lambda: [{"Alive": True, "Resources": {"GPU": 8.0}},
                                                     {"Alive": True, "Resources": {"GPU": 6.0}}])
    cfg = tiny_config(["rollout.engine=sglang", "rollout.sglang_gpus=16", "rollout.sglang_gpus_per_host=8",
                             f"trainer.output_dir={tmp_path}"])
    with pytest.raises(RuntimeError, match=r"rollout.sglang_gpus=16 in server hosts of rollout.sglang_gpus_per_host="
                                           r"8: 2 hosts, and this Ray cluster's nodes have room for 1 of 8 GPUs"):
        group.start_server_hosts(cfg)
    for bad, why in ((["rollout.sglang_gpus=16", "rollout.sglang_gpus_per_host=6"], "must be a multiple"),
                     (["rollout.sglang_gpus=8", "rollout.sglang_tp=4", "rollout.sglang_gpus_per_host=2"],
                      "must be a multiple of rollout.sglang_tp=4"),
                     (["rollout.sglang_gpus_per_host=8"], "it needs rollout.sglang_gpus")):
        with pytest.raises(ConfigError, match=why):
            tiny_config(["rollout.engine=sglang", f"trainer.output_dir={tmp_path}", *bad])


def test_hosts_ray_cannot_place_are_ended_with_an_error(ray_two_gpus, monkeypatch, tmp_path):
    """The node list seems to have room (4 GPUs on one node) but no node has 2 GPUs to give: after the placement
    deadline every host is ended and the error names the setting, without waiting forever."""
    import ray

    from megarl.workers import group

    monkeypatch.setattr(group.ray, "nodes", lambda: [{"Alive": True, "Resources": {"GPU": 4.0}}])
    cfg = tiny_config(["rollout.engine=sglang", "rollout.sglang_gpus=4", "rollout.sglang_gpus_per_host=2",
                             f"trainer.output_dir={tmp_path}"])
    with pytest.raises(RuntimeError, match=r"rollout.sglang_gpus_per_host=2: Ray placed 0 of 2 SGLang server hosts "
                                           r"within 3 s"):
        group.start_server_hosts(cfg, placement_s=3)
    deadline = time.monotonic() + 30  # nothing of theirs is left holding GPUs
    while ray.available_resources().get("GPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU", 0) == 2


def test_colocated_servers_on_one_node_are_the_rollout_actors_on_that_node(ray_two_gpus, tmp_path):
    """Training ranks on one node: the rollout actor is placed on that node (not wherever Ray has room) and starts
    the servers itself, on the training GPUs, with no server host."""
    import ray

    from megarl.workers.group import start_rollout, stop_rollout

    model = tmp_path / "model-one-node"
    model.mkdir()
    (tmp_path / "out").mkdir()
    nodes = [n["NodeID"] for n in ray.nodes() if n["Resources"].get("GPU")]
    cfg = tiny_config(["rollout.engine=sglang", f"trainer.output_dir={tmp_path / 'out'}",
                             "trainer.verify_weight_sync_every=0"])
    actor = start_rollout(cfg, str(model), "cpu", [(nodes[1], ["0"])])
    try:
        node = ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=120)
        assert node == nodes[1]
        ((guard, server),) = servers_of(str(model))
        owner = int(Path(f"/proc/{guard}/cmdline").read_bytes().split(b"\0")[2])
        assert owner == ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        assert b"\0CUDA_VISIBLE_DEVICES=0\0" in Path(f"/proc/{server}/environ").read_bytes()
    finally:
        stop_rollout(actor)
