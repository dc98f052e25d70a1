"""A real single-host Slurm cluster for tests: munged + slurmctld + one slurmd per node.

Debian's slurm-wlm is built with --enable-multiple-slurmd, so every Slurm node
is its own ``slurmd -N NAME`` on this host, told apart by its own port
(``NodeName=... Port=``); no namespaces are needed. munged runs with its own
key and socket (slurm.conf ``AuthInfo=socket=``), so a system munge is neither
needed nor touched.

* everything lives in a temp dir whose name carries the test process's PID:
  slurm.conf, cgroup.conf, munge key/socket, StateSaveLocation, SlurmdSpoolDir,
  logs; ports are probed free first;
* clients (scontrol, srun, ...) find the cluster through ``SLURM_CONF`` in
  ``Cluster.env`` (set it in os.environ to make jitrun.devices.slurm use it);
* teardown cancels the cluster's jobs, then stops the daemons by PID and kills
  by PID whatever else still carries this cluster's SLURM_CONF in its
  environment (slurmstepd, srun, tasks), and removes the temp dir, even when a
  test fails.

Needs root; slurm-wlm is installed with apt-get when missing, tests skip with
the reason when that is impossible (``start`` raises ``Unavailable``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SBIN = ("/usr/sbin", "/usr/bin", "/sbin")


class Unavailable(RuntimeError):
    """Slurm cannot run here; the message says why (tests skip with it)."""


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def ensure_installed() -> None:
    if _which("slurmctld") and _which("slurmd") and _which("munged") and _which("srun"):
        return
    if os.geteuid() != 0 or not _which("apt-get"):
        raise Unavailable("slurm-wlm is not installed and cannot be installed here (needs root and apt-get): "
                          "apt-get install slurm-wlm")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm"]):
        try:
            cp = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"`{' '.join(argv)}` timed out") from None
        if cp.returncode != 0:
            raise Unavailable(f"`{' '.join(argv)}` failed ({cp.returncode}): {cp.stderr.strip()[-500:]}")


def _free_ports(count: int) -> int:
    """First port of ``count`` consecutive free TCP ports, starting from one derived from our PID."""
    start = 20000 + (os.getpid() % 2000) * 10
    for base in range(start, 60000, count + 7):
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("", port))
            return base
        except OSError:
            continue
    raise Unavailable(f"no {count} consecutive free TCP ports above {start}")


@dataclass
class Cluster:
    dir: Path
    nodes: list[str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm clients: ours minus any outer Slurm job, plus this cluster's config."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_", "SALLOC_", "SBATCH_"))}
        return {**env, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        cp = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and cp.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` exited {cp.returncode}: {cp.stderr.strip()}")
        return cp

    def node(self, name: str) -> str:
        """``scontrol show node NAME`` (multi-line: Reason= keeps its spaces)."""
        return self.run("scontrol", "show", "node", name).stdout

    def states(self) -> dict[str, str]:
        out = self.run("sinfo", "--noheader", "--Node", "--format", "%N %T").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_idle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                states = self.states()
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                states = {"?": str(e)}
            if set(states) == set(self.nodes) and all(s == "idle" for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"slurm nodes not idle after {timeout:.0f}s: {states}\n{self.logs()}")
            time.sleep(0.3)

    def reset(self) -> None:
        """Cancel all jobs and resume all nodes (a test's drains do not leak into the next test)."""
        self.cancel_jobs()
        self.run("scontrol", "update", f"NodeName={','.join(self.nodes)}", "State=RESUME", check=False)
        self.wait_idle()

    def cancel_jobs(self, timeout: float = 15) -> None:
        jobs = self.run("squeue", "--noheader", "--format", "%i", check=False).stdout.split()
        if jobs:
            self.run("scancel", *jobs, check=False)
        deadline = time.monotonic() + timeout
        while self.run("squeue", "--noheader", "--format", "%i", check=False).stdout.split():
            if time.monotonic() > deadline:
                break
            time.sleep(0.3)

    def logs(self, lines: int = 15) -> str:
        out = []
        for p in sorted(self.dir.glob("log/*")):
            tail = p.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {p.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def _stray_pids(self) -> list[int]:
        """Processes (not us) whose environment names this cluster's slurm.conf: daemons,
        slurmstepd, srun and the tasks they started."""
        marker = f"SLURM_CONF={self.conf}".encode() + b"\0"
        pids = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) != os.getpid():
                try:
                    if marker in (d / "environ").read_bytes():
                        pids.append(int(d.name))
                except OSError:
                    continue
        return pids

    def stop(self) -> None:
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            try:
                self.cancel_jobs()
            except (OSError, subprocess.TimeoutExpired):
                pass
        # slurmds first (they stop their steps), the controller, munge last.
        order = [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.terminate()
        for name in order:
            p = self.procs.get(name)
            if p is None:
                continue
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pid in self._stray_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


SLURM_CONF = """\
ClusterName=jit{pid}
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.sock
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/linear
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait={kill_wait}
InactiveLimit=0
MinJobAge=30
NodeName=DEFAULT CPUs=1 State=UNKNOWN
{node_lines}
PartitionName=jit Nodes={nodes} Default=YES MaxTime=INFINITE State=UP
"""


@contextmanager
def start(nodes: int = 3, prefix: str = "n", kill_wait: int = 2) -> Iterator[Cluster]:
    """Run a cluster with nodes ``{prefix}1..{prefix}{nodes}``, all idle on entry; torn down on exit.
    ``kill_wait``: seconds between a cancelled job's SIGTERM and its SIGKILL (Slurm's KillWait;
    its default is 30, short here so that a test's kills are quick)."""
    ensure_installed()
    if os.geteuid() != 0:
        raise Unavailable("the Slurm test cluster runs slurmd as root (SlurmdUser=root); run the tests as root")
    d = Path(tempfile.mkdtemp(prefix=f"jitslurm-{os.getpid()}-"))
    d.chmod(0o755)  # slurmstepd and munged check the path
    for sub in ("state", "spool", "log"):
        (d / sub).mkdir()
    names = [f"{prefix}{i}" for i in range(1, nodes + 1)]
    base = _free_ports(nodes + 2)
    # Every node is a slurmd on this host with a port of its own (multiple-slurmd).
    node_lines = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={base + 2 + i}"
                           for i, n in enumerate(names))
    (d / "slurm.conf").write_text(SLURM_CONF.format(pid=os.getpid(), ctld_port=base, slurmd_port=base + 1, dir=d,
                                                    nodes=",".join(names), node_lines=node_lines,
                                                    kill_wait=kill_wait))
    # proctrack/linuxproc + task/none use no cgroups; slurmd still reads this file.
    (d / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")
    key = d / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    cluster = Cluster(d, names)
    env = cluster.env

    def daemon(name: str, argv: list[str]) -> None:
        log = open(d / "log" / f"{name}.out", "wb")  # the child keeps its own copy
        cluster.procs[name] = subprocess.Popen([_which(argv[0]) or argv[0], *argv[1:]], env=env, stdout=log,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True)
        log.close()

    try:
        # -F foreground (we hold its PID), -f: run as root and accept the key under /tmp.
        daemon("munged", ["munged", "-F", "-f", f"--socket={d}/munge.sock", f"--key-file={key}",
                          f"--pid-file={d}/munged.pid", f"--log-file={d}/log/munged.log",
                          f"--seed-file={d}/munged.seed"])
        _wait_for(lambda: (d / "munge.sock").exists(), 10, "munged socket", cluster)
        daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(cluster.conf)])
        _wait_for(lambda: cluster.run("scontrol", "ping", check=False).stdout.count("is UP") > 0, 20,
                  "slurmctld", cluster)
        for n in names:
            # Each node's slurmd (and every task it starts) in a mount namespace of its own
            # with a private /dev/shm, as a real node has: what a killed node's processes
            # leave there (multiprocessing's named semaphores) goes with the node.
            # unshare and sh exec, so the PID we hold stays slurmd's.
            daemon(f"slurmd.{n}", ["unshare", "-m", "--propagation", "private", "sh", "-c",
                                   'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$@"', "sh",
                                   _which("slurmd") or "slurmd", "-D", "-N", n, "-f", str(cluster.conf)])
        cluster.wait_idle()
        yield cluster
    finally:
        cluster.stop()


def _wait_for(ok, timeout: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up (exited: {dead})\n{cluster.logs()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster():
    """A 3-node Slurm cluster for one test module (skipped where Slurm cannot run)."""
    try:
        with start(nodes=3) as c:
            yield c
    except Unavailable as e:
        pytest.skip(str(e))
