"""Multi-node test harness: nodes as network namespaces on one machine.

Every multi-node, erasure-coding and CRIU test uses this one harness:

* a hub namespace holds a bridge; each node is a namespace joined to it by a
  veth pair, with one address of 198.18.0.0/24 (the benchmarking range; it
  exists only inside the namespaces made here) and its own loopback;
* each process started on a node runs in a private mount namespace
  (``unshare -m --propagation private``) where its ``--jit-dir`` and
  ``/dev/shm`` are tmpfs of its own: a node cannot read another node's files
  by path, and the node's disk is gone with its last process, as when a host
  vanishes;
* names carry the test process's PID (and a counter), so concurrent runs do
  not collide;
* teardown kills exactly the processes inside the namespaces made here (by
  PID, from ``ip netns pids``), deletes the namespaces (and with them the
  veths and the bridge) and the host-side temp dir, even when a test fails.

Needs root, iproute2 and util-linux ``unshare``; tests skip with the reason
otherwise (``Cluster.unavailable()``).
"""

from __future__ import annotations

import itertools
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "198.18.0"
_counter = itertools.count()


def _tool(name: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
    return shutil.which(name, path=path)


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def signal_all(pids: list[int], *sigs: int) -> list[int]:
    """Send each signal in turn to every pid (ours, by PID); gone ones are skipped."""
    for sig in sigs:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return pids


@dataclass
class Proc:
    """A process tree started on a node (its own session)."""

    node: Node
    popen: subprocess.Popen
    log: Path
    name: str

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def host_path(self, path: str) -> Path:
        """Where the host sees ``path`` as this process tree sees it (its private tmpfs
        included): through /proc/PID/root of the tree's first process (``ip netns
        exec`` and ``unshare -m`` exec, so that PID is the bash inside the private
        mount namespace). Valid while that process lives."""
        return Path(f"/proc/{self.popen.pid}/root") / path.lstrip("/")


def copy_dir(src: Proc, src_path: str, dst: Proc, dst_path: str) -> None:
    """Copy a directory from one node's private files to another's through the host,
    as an operator's scp would (a node cannot read another node's files by path).
    Both process trees must be alive; ``dst_path``'s parent must exist on ``dst``."""
    shutil.copytree(src.host_path(src_path), dst.host_path(dst_path), symlinks=True)


@dataclass
class Node:
    cluster: Cluster
    index: int
    ns: str
    addr: str
    ifname: str = "eth0"
    procs: list[Proc] = field(default_factory=list)

    def exec_prefix(self) -> list[str]:
        return [self.cluster.ip, "netns", "exec", self.ns]

    def run(self, cmd: list[str], *, name: str, env: dict | None = None, private_dirs: tuple[str, ...] = (),
            keep: tuple[tuple[str, str], ...] = (), shared_shm: bool = False) -> Proc:
        """Start ``cmd`` on this node in a private mount namespace.

        ``private_dirs``: host paths that get a fresh tmpfs (0700) visible only
        to this process tree; ``/dev/shm`` always does. ``keep``: (src, dst)
        copies made after ``cmd`` exits (the tmpfs vanishes with the mount
        namespace), so a test can read a node's event log afterwards.
        ``shared_shm``: keep the host's ``/dev/shm``, for the CUDA/NCCL stand-in only:
        its NCCL carries data between ranks through host shared memory, so there it
        is the nodes' interconnect, not their disk (``--jit-dir`` stays private).
        """
        mounts = ["true"] if shared_shm else ["mount -t tmpfs -o mode=1777 jitshm /dev/shm"]
        for d in private_dirs:
            os.makedirs(d, exist_ok=True)
            mounts.append(f"mount -t tmpfs -o mode=0700 jitnode {shlex.quote(d)}")
        copies = [f"cp -r {shlex.quote(s)} {shlex.quote(d)} 2>/dev/null" for s, d in keep]
        script = " && ".join(mounts) + ' && { "$@"; rc=$?; ' + "; ".join(copies + ["exit $rc"]) + "; }"
        full = [*self.exec_prefix(), self.cluster.unshare, "-m", "--propagation", "private",
                "bash", "-c", script, "jitnode", *cmd]
        log = self.cluster.dir / f"{name}.log"
        fh = open(log, "w")
        popen = subprocess.Popen(full, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, "JITCKPT_TOKEN": self.cluster.token, **(env or {})},
                                 cwd=self.cluster.dir)
        fh.close()
        p = Proc(self, popen, log, name)
        self.procs.append(p)
        return p

    def pids(self) -> list[int]:
        cp = _run(self.cluster.ip, "netns", "pids", self.ns, check=False)
        return [int(x) for x in cp.stdout.split()]

    def kill(self, sig: int = signal.SIGKILL) -> list[int]:
        """Every process on this node (a whole host failing)."""
        return signal_all(self.pids(), sig)


class Cluster:
    """``with Cluster(3) as c: c.nodes[0].run([...], name="agent0")``"""

    def __init__(self, n: int, tag: str = "t") -> None:
        self.n = n
        uid = f"{os.getpid()}{next(_counter)}"
        self.prefix = f"jit{tag}{uid}"[:11]  # veth names are at most 15 bytes
        self.ip = _tool("ip") or "ip"
        self.unshare = _tool("unshare") or "unshare"
        self.hub = f"{self.prefix}h"
        self.dir = Path(tempfile.mkdtemp(prefix=f"jitcluster-{uid}-"))
        self.nodes: list[Node] = []
        self._made: list[str] = []
        # the job token every node's jitrun gets, as an operator would set it: jitrun
        # never shares it through the store
        self.token = secrets.token_hex(16)

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be used here, or None."""
        if os.geteuid() != 0:
            return "multi-node tests need root (network and mount namespaces)"
        for t in ("ip", "unshare"):
            if _tool(t) is None:
                return f"{t} not found (Debian: apt-get install iproute2 util-linux)"
        probe = f"jitprobe{os.getpid()}"
        cp = _run(_tool("ip") or "ip", "netns", "add", probe, check=False)
        if cp.returncode != 0:
            return f"cannot create network namespaces: {cp.stderr.strip()}"
        _run(_tool("ip") or "ip", "netns", "del", probe, check=False)
        return None

    def add_node(self) -> Node:
        """Create one more node (also after start: a replacement or a spare)."""
        i = len(self.nodes)
        ns = f"{self.prefix}n{i}"
        ip = self.ip
        _run(ip, "netns", "add", ns)
        self._made.append(ns)
        host_end = f"{self.prefix}v{i}"
        _run(ip, "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run(ip, "link", "set", host_end, "netns", self.hub)
        _run(ip, "-n", self.hub, "link", "set", host_end, "master", "br0", "up")
        addr = f"{SUBNET}.{i + 1}"
        _run(ip, "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _run(ip, "-n", ns, "link", "set", "eth0", "up")
        _run(ip, "-n", ns, "link", "set", "lo", "up")
        node = Node(self, i, ns, addr)
        self.nodes.append(node)
        return node

    def __enter__(self) -> Cluster:
        try:
            _run(self.ip, "netns", "add", self.hub)
            self._made.append(self.hub)
            _run(self.ip, "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run(self.ip, "-n", self.hub, "link", "set", "br0", "up")
            for _ in range(self.n):
                self.add_node()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def teardown(self) -> None:
        for node in self.nodes:
            node.kill(signal.SIGKILL)
        for node in self.nodes:
            for p in node.procs:
                try:
                    p.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        deadline = time.monotonic() + 5
        while any(n.pids() for n in self.nodes) and time.monotonic() < deadline:
            time.sleep(0.05)
        for ns in reversed(self._made):
            _run(self.ip, "netns", "del", ns, check=False)
        self._made.clear()
        if not os.environ.get("JITCKPT_KEEP_CLUSTER_DIR"):
            shutil.rmtree(self.dir, ignore_errors=True)


# CRIU across nodes (tests/test_criu.py, tests/test_migrate_mechanism.py): run on the target
# node, waits for the copied images, restores them as the child subreaper, waits for the worker.
CRIU_RESTORE_ON_NODE = textwrap.dedent('''
    import ctypes, os, sys, time
    from jitrun.migration import criu
    images = sys.argv[1]
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # child subreaper: the restored tree becomes ours
    while not os.path.exists(os.path.join(images, "copied")):
        time.sleep(0.02)
    os.unlink(os.path.join(images, "copied"))
    t0 = time.monotonic()
    pid = criu.restore(images)
    print(f"RESTORED {time.monotonic() - t0:.3f} {pid}", flush=True)
    _, status = os.waitpid(pid, 0)
    print(f"EXIT {os.waitstatus_to_exitcode(status)}", flush=True)
''')


def wait_for_line(proc: Proc, word: str, timeout: float) -> str:
    """The first line of ``proc``'s output starting with ``word``; fails when the
    process exits or ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while True:
        for line in proc.output().splitlines():
            if line.startswith(word):
                return line
        assert proc.popen.poll() is None, f"{proc.name} exited:\n{proc.output()[-3000:]}"
        assert time.monotonic() < deadline, f"no {word} within {timeout}s:\n{proc.output()[-3000:]}"
        time.sleep(0.05)


class MigratableProcs:
    """Processes a CRIU test started on this host, each PID 1 of its own PID
    namespace (jitrun.migration.criu.migratable_command), plus any it restored (append
    to ``pids``); all killed and reaped by :meth:`cleanup`."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.popens: list[subprocess.Popen] = []

    def start(self, cmd: list[str], output: Path | None = None, env: dict | None = None
              ) -> tuple[subprocess.Popen, int]:
        """``output``: a file only the worker writes (a restore checks its size)."""
        from jitrun.migration import criu

        p = subprocess.Popen(criu.migratable_command(cmd, output=output), stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                             env=env)
        self.popens.append(p)
        pid = criu.ns_init_pid(p.pid)
        self.pids.append(pid)
        return p, pid

    def cleanup(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        for p in self.popens:
            p.kill()
            p.wait(timeout=10)
