"""A real Slurm cluster on this machine, for the sbatch tests: munged, slurmctld, and one slurmd per node,
each node in its own network namespace (its own IP, loopback and hostname), joined by a bridge to the
controller, which stays in the host namespace. Needs root, `ip`, `unshare` and Debian's slurm-wlm and
munge packages (see docs/launching.md for the CI set-up). Everything lives under one directory and is
stopped by pid; interfaces and namespaces carry a per-instance suffix.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.dist_utils import free_port

REQUIRED = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel", "ip", "nsenter", "unshare")


def missing_requirements() -> list[str]:
    missing = [tool for tool in REQUIRED if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root (network namespaces, slurmd)")
    return missing


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class LocalSlurm:
    def __init__(self, root: Path, nodes: int = 2, cpus: int = 2):
        self.root, self.cpus = root, cpus
        tag = os.getpid() % 10000
        self.subnet = f"10.{200 + tag % 50}.{tag % 250}"
        self.bridge = f"mrlb{tag}"
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.netns = {n: f"mrl{tag}{n}" for n in self.nodes}
        self.ips = {n: f"{self.subnet}.{11 + i}" for i, n in enumerate(self.nodes)}
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.daemons: list[subprocess.Popen] = []
        # job ids name per-job paths on the nodes (/tmp/ray_<job>_<node>): keep them apart between runs
        self.first_job_id = 1000 + int.from_bytes(os.urandom(3), "little")
        self.jobs: list[str] = []

    # ---- start --------------------------------------------------------------------------------------

    def start(self) -> "LocalSlurm":
        try:
            self._network()
            self._munge()
            self._write_conf()
            self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
            for n in self.nodes:
                # a hostname per node (its own UTS namespace): slurmd finds its NodeName from it. nsenter,
                # not `ip netns exec`, which remounts /sys and so hides the cgroup tree slurmd needs.
                self._daemon(["nsenter", f"--net=/run/netns/{self.netns[n]}", "unshare", "--uts", "sh", "-c",
                              f"hostname {n} && exec slurmd -D -f {self.conf}"], f"slurmd-{n}")
            self._wait_idle(timeout=60)
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self) -> None:
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        for i, n in enumerate(self.nodes):
            ns, host_end = self.netns[n], f"{self.bridge}v{i}"
            run("ip", "netns", "add", ns)
            run("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            run("ip", "link", "set", host_end, "master", self.bridge, "up")
            run("ip", "-n", ns, "addr", "add", f"{self.ips[n]}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")

    def _munge(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = self.root / "munge.sock"
        self._daemon(["munged", "-F", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                      f"--pid-file={self.root / 'munged.pid'}", f"--seed-file={self.root / 'munged.seed'}",
                      f"--log-file={self.root / 'munged.log'}"], "munged")
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {(self.root / 'munged.out').read_text()[-2000:]}")
            time.sleep(0.1)

    def _write_conf(self) -> None:
        (self.root / "state").mkdir()
        for n in self.nodes:
            (self.root / "spool" / n).mkdir(parents=True)
        nodes = "\n".join(f"NodeName={n} NodeAddr={self.ips[n]} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
                          for n in self.nodes)
        r = self.root
        self.conf.write_text(f"""\
ClusterName=megarltest
FirstJobId={self.first_job_id}
SlurmctldHost={socket.gethostname().split('.')[0]}({self.subnet}.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
KillWait=10
InactiveLimit=0
{nodes}
PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")

    def _daemon(self, cmd: list[str], name: str) -> None:
        with open(self.root / f"{name}.out", "w") as out:
            self.daemons.append(subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                                 start_new_session=True))

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True,
                                    text=True).stdout.split("\n")
            idle = {line.split()[0] for line in states if line.endswith(" idle")}
            if idle >= set(self.nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"slurm nodes not idle after {timeout} s: {states}; see {self.root}/*.log")
            time.sleep(0.5)

    # ---- use ----------------------------------------------------------------------------------------

    def sbatch(self, args: list[str], env: dict[str, str], cwd: Path) -> str:
        out = subprocess.run(["sbatch", "--parsable", *args], env=env | {"SLURM_CONF": str(self.conf)}, cwd=cwd,
                             capture_output=True, text=True, check=True).stdout
        self.jobs.append(out.strip().split(";")[0])
        return self.jobs[-1]

    def job_state(self, job_id: str) -> str:
        """The job's state from the controller ('' once it has left the queue and its record expired)."""
        out = subprocess.run(["scontrol", "show", "job", job_id, "-o"], env=self.env, capture_output=True,
                             text=True).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return fields.get("JobState", "")

    def wait_job(self, job_id: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (state := self.job_state(job_id)) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout} s")
            time.sleep(0.5)
        return state

    def scancel(self, job_id: str) -> None:
        run_env = subprocess.run(["scancel", job_id], env=self.env, capture_output=True, text=True)
        assert run_env.returncode == 0, run_env.stderr

    # ---- stop ---------------------------------------------------------------------------------------

    def stop(self) -> None:
        if len(self.daemons) > 2:  # the controller is up: cancel what is left while the nodes can clean up
            subprocess.run(["scancel", "--full", "--partition=test"], env=self.env, capture_output=True)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and subprocess.run(
                    ["squeue", "-h"], env=self.env, capture_output=True, text=True).stdout.strip():
                time.sleep(0.5)
        for p in reversed(self.daemons):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        for i, ns in enumerate(self.netns.values()):
            subprocess.run(["ip", "link", "del", f"{self.bridge}v{i}"], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
