"""Multi-node jobs with real torch (gloo): nodes are network namespaces, each
agent in a private mount namespace whose --jit-dir and /dev/shm are its own
tmpfs (tests/netns.py). Every recovered job must end with exit 0 on every
agent, bit-identical to a failure-free plain-torchrun run of the same world,
with at most one minibatch redone per failure."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import TRAIN, assert_same_state, assert_verified_fingerprint, run_reference
from netns import Cluster, Node, Proc, signal_all

from jitckpt.wire.config import EXIT_SAVED

WHY = Cluster.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY is not None, reason=WHY or "")]

PORT = 29400
BASE_ENV = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


class Job:
    """One multi-node jitrun job on a Cluster (same command on every node)."""

    def __init__(self, cluster: Cluster, nproc: int, steps: int, *, train: list[str] = (),
                 extra: list[str] = (), nnodes: int | None = None, timeout_s: float | str = 5,
                 rdzv_conf: str = "keep_alive_interval=2", static: bool = False,
                 script: list[str] | None = None) -> None:
        self.rdzv_conf = rdzv_conf
        self.static = static  # the classic --nnodes/--node-rank/--master-addr form
        self.c = cluster
        self.nnodes = nnodes or len(cluster.nodes)
        self.nproc = nproc
        self.steps = steps
        self.jit = str(cluster.dir / "jit")
        self.out = cluster.dir / "final.pt"
        self.train = list(train)
        self.extra = list(extra)
        # a user's script and its arguments instead of tests/fault_train.py (which ``train`` extends)
        self.script = script
        self.timeout_s = timeout_s
        self.procs: dict[str, Proc] = {}

    def cmd(self, node: Node) -> list[str]:
        if self.static:
            rdzv = ["--node-rank", str(node.index), "--master-addr", self.c.nodes[0].addr, "--master-port", str(PORT)]
        else:
            rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.c.nodes[0].addr}:{PORT}", "--rdzv-id", "mn",
                    "--rdzv-conf", self.rdzv_conf]
        return [sys.executable, "-m", "jitrun.cli", "--nnodes", str(self.nnodes), "--nproc-per-node", str(self.nproc),
                *rdzv, "--max-restarts", "3", "--jit-timeout", str(self.timeout_s),
                "--jit-dir", self.jit, "--local-addr", node.addr, *self.extra,
                *(self.script or [str(TRAIN), "--steps", str(self.steps), "--out", str(self.out), *self.train])]

    def start(self, node: Node, name: str | None = None, env: dict | None = None) -> Proc:
        name = name or f"agent{node.index}"
        keep = ((f"{self.jit}/events.jsonl", str(self.c.dir / f"events-{name}.jsonl")),)
        p = node.run(self.cmd(node), name=name, env={**BASE_ENV, **(env or {})}, private_dirs=(self.jit,), keep=keep)
        self.procs[name] = p
        return p

    def start_all(self, env: dict | None = None, env_of: dict[int, dict] | None = None) -> None:
        for node in self.c.nodes[: self.nnodes]:
            self.start(node, env={**(env or {}), **(env_of or {}).get(node.index, {})})

    def wait(self, timeout: float = 240, killed: tuple[str, ...] = ()) -> dict[str, int]:
        """Every agent's exit code. ``killed``: agents whose node the test
        killed; each must have died of that SIGKILL, and is left out of the
        returned codes."""
        deadline = time.monotonic() + timeout
        codes = {}
        for name, p in self.procs.items():
            try:
                code = p.wait(max(deadline - time.monotonic(), 1))
            except Exception:
                pytest.fail(f"{name} did not finish in {timeout}s\n" + self.logs())
            if name in killed:
                assert code == -9, f"{name}, whose node was killed, exited {code}\n{self.logs()}"
            else:
                codes[name] = code
        return codes

    def wait_for_output(self, name: str, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.procs[name].output():
            if time.monotonic() > deadline or self.procs[name].popen.poll() is not None:
                pytest.fail(f"{name} never printed {text!r}\n" + self.logs())
            time.sleep(0.05)

    def events(self, name: str) -> list[dict]:
        p = self.c.dir / f"events-{name}.jsonl"
        return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []

    def all_events(self) -> list[dict]:
        return sorted((e for n in self.procs for e in self.events(n)), key=lambda e: e["t"])

    def wait_spare(self, timeout: float = 120) -> None:
        """Until a training agent says it saw the spare waiting in the rendezvous
        (the spare's agent is up then: its migration target listens before it
        joins). Its output, not its events: those are on the node's own disk."""
        deadline = time.monotonic() + timeout
        while not any("waiting to join; kept as spare" in p.output() for n, p in self.procs.items() if n != "spare"):
            if time.monotonic() > deadline or self.procs["spare"].popen.poll() is not None:
                pytest.fail("no agent saw the spare waiting\n" + self.logs())
            time.sleep(0.1)

    def logs(self) -> str:
        return "\n".join(f"===== {n}\n{p.output()[-3000:]}" for n, p in self.procs.items())

    def assert_recovered(self, reference: Path, failures: int = 1, killed: tuple[str, ...] = ()) -> list[dict]:
        codes = self.wait(killed=killed)
        if not all(c == 0 for c in codes.values()):
            pytest.fail(f"exit codes {codes}\n{self.logs()}")
        evs = self.all_events()
        recs = [e for e in evs if e["event"] == "recovery"]
        if len(recs) != failures:
            pytest.fail(f"{len(recs)} recovery events, expected {failures}: {recs}\n{self.logs()}")
        for r in recs:
            assert r["redone_minibatches"] is not None and r["redone_minibatches"] <= 1, r
            assert_verified_fingerprint(r)
        loaded = [e for e in evs if e["event"] == "loaded"]
        # every rank of the last attempt reported the step it loaded: the same one
        last = max((e for e in evs if e["event"] == "rendezvous"), key=lambda e: e["round"])["round"]
        last_loaded = [e for e in loaded if e["t"] >= _round_start(evs, last)]
        assert len(last_loaded) == self.nnodes * self.nproc, (last_loaded, self.logs())
        assert len({json.dumps(e["loaded"]) for e in last_loaded}) == 1, last_loaded
        nodes = {e.get("node") for e in evs if e["event"] == "job_end"}
        assert len(nodes) == len(codes), "every agent wrote its own timeline, naming its node"
        assert_same_state(reference, self.out)
        return evs


def _round_start(evs: list[dict], rnd: int) -> float:
    return min(e["t"] for e in evs if e["event"] == "rendezvous" and e["round"] == rnd)


@pytest.fixture(scope="session")
def mn_reference(reference):
    """The failure-free final state of a world of ``nnodes`` x ``nproc`` ranks:
    plain torchrun's on one node with the same ranks. gloo reduces in rank
    order whatever the transport, so it is bit-identical to plain torchrun in
    namespaces (compared when this replaced the namespace runs, 2 x 1 and
    2 x 2 ranks; a namespace reference cost a cluster per world and worker)."""

    def get(nnodes: int, nproc: int, steps: int) -> Path:
        return reference(nnodes * nproc, steps)

    return get


def _fault(rank: int, kind: str, phase: str = "backward", step: int = 9) -> dict:
    return {"JITCKPT_FAULT": f"rank={rank},step={step},phase={phase},kind={kind}"}


STEPS = 24


KINDS = {"sigkill": "backward", "sigstop": "forward", "exception": "optimizer"}
# Pairwise, not the full product (each test starts a cluster of agents and
# costs most of a minute on two cores): every failure kind and every lost-node
# shape meets both node counts and both rank counts per node, and every world
# is covered by some recovery of each kind of test.
A, B = [(2, 1), (3, 2)], [(2, 2), (3, 1)]
RANK_FAILURES = [(*w, "sigkill") for w in A] + [(*w, "sigstop") for w in B] + [(*w, "exception") for w in A]


@pytest.mark.parametrize("nnodes,nproc,kind", RANK_FAILURES)
def test_rank_failure(nnodes, nproc, kind, mn_reference):
    phase = KINDS[kind]
    ref = mn_reference(nnodes, nproc, STEPS)
    with Cluster(nnodes) as c:
        job = Job(c, nproc, STEPS)
        job.start_all(env=_fault(nnodes * nproc - 1, kind, phase))
        evs = job.assert_recovered(ref)
        # the failed rank's node had no replica: it was decided job-wide and fetched
        dec = [e for e in evs if e["event"] == "restore_decision"]
        assert dec and len({e["step"] for e in dec}) == 1, dec
        if kind == "sigstop":
            # confirmed by the stopped rank's own agent, never by a node whose ranks only wait; that node's
            # agent asks the others (hang_suspect, the hang watch's only store traffic), which is how a
            # rank alone on its node is found
            det = [e for e in evs if e["event"] == "hang_detected"]
            assert len(det) == 1 and det[0]["hung"] == {str(nnodes * nproc - 1): "stopped"}, det
            assert nproc > 1 or any(e["event"] == "hang_suspect" for e in evs), evs


THREE = ("rank=1,step=4,phase=backward,kind=sigkill;rank=0,step=9,phase=forward,kind=sigstop,attempt=1;"
         "rank=1,step=14,phase=optimizer,kind=exception,attempt=2")


@pytest.mark.parametrize("form", ["static", "c10d"])
def test_two_node_launch_forms(form, mn_reference):
    """The classic static form (--nnodes 2 --node-rank K --master-addr A
    --master-port P) and c10d, two nodes: a killed rank, a rank stopped past
    the timeout and an exception, one per attempt, each recovered from the
    job-wide decision; attempts count up on both nodes; every fault fires once."""
    ref = mn_reference(2, 1, STEPS)
    with Cluster(2) as c:
        job = Job(c, 1, STEPS, static=form == "static", timeout_s=3)
        job.start_all(env={"JITCKPT_FAULT": THREE})
        evs = job.assert_recovered(ref, failures=3)
        fired = sorted((e["attempt"], e["kind"]) for e in evs if e["event"] == "fault_injected")
        assert fired == [(0, "sigkill"), (1, "sigstop"), (2, "exception")], (fired, job.logs())
        for name in job.procs:
            rounds = [e["round"] for e in job.events(name) if e["event"] == "rendezvous"]
            assert rounds == [0, 1, 2, 3], (name, rounds)
        dec = [e for e in evs if e["event"] == "restore_decision"]
        assert len({(e["round"], e["step"]) for e in dec}) == 3, dec


@pytest.mark.parametrize("nnodes,nproc", B)
def test_slow_save_fn(nnodes, nproc, mn_reference):
    """A 2 s save_fn: the node whose rank died waits for the job-wide decision
    instead of choosing from its own (empty) disk."""
    ref = mn_reference(nnodes, nproc, STEPS)
    with Cluster(nnodes) as c:
        job = Job(c, nproc, STEPS, train=["--save-sleep", "2"])
        job.start_all(env=_fault(nnodes * nproc - 1, "sigkill"))
        evs = job.assert_recovered(ref)
        saved = [e for e in evs if e["event"] == "checkpoint_saved"]
        assert saved and all(e["seconds"] >= 2 for e in saved)


LONG = 90  # steps at 0.05 s extra each: long enough to lose a node mid-training
PAUSE = 9  # the step before whose forward the ranks of a node the test will kill stop themselves
PAUSED = "fixed:60"  # --jit-timeout while a node's ranks wait stopped for the test to kill it


def _stop_on(job: Job, node: Node, step: int = PAUSE) -> dict[int, dict]:
    """``env_of`` for ``Job.start_all``: every rank on ``node`` stops itself
    (SIGSTOP) before ``step``'s forward, so the test kills the node at a known
    minibatch however slow the host, with no training time spent waiting for
    it. Which global ranks land on a node is the rendezvous' choice: the node
    gets a spec for every rank; only its own fire. A stopped rank is a hang the
    learned bound finds within a second, so the job runs with a fixed timeout
    longer than the pause (``PAUSED``): the node's loss is then what the peers see."""
    world = job.nnodes * job.nproc
    specs = ";".join(f"rank={r},step={step},phase=forward,kind=sigstop" for r in range(world))
    return {node.index: {"JITCKPT_FAULT": specs}}


def _stopped_worker(node: Node, timeout: float = 120) -> int:
    """Until a training process on ``node`` is stopped (its injected SIGSTOP); its PID."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in node.pids():
            try:
                p = psutil.Process(pid)
                if p.status() == psutil.STATUS_STOPPED:  # only the rank stops itself (forked from a warm server)
                    return pid
            except psutil.Error:
                continue
        time.sleep(0.05)
    pytest.fail(f"no training process on {node.addr} stopped in {timeout}s")


def _lose(node: Node) -> None:
    """Kill ``node`` (every process on it, as a host failing) once its ranks stopped at the pause."""
    _stopped_worker(node)
    assert node.kill(), "the node had processes"


@pytest.mark.parametrize("nnodes,nproc", A)
def test_node_lost_and_replaced(nnodes, nproc, mn_reference):
    ref = mn_reference(nnodes, nproc, STEPS)
    with Cluster(nnodes) as c:
        lost = c.nodes[-1]
        job = Job(c, nproc, STEPS, timeout_s=PAUSED)
        job.start_all(env_of=_stop_on(job, lost))
        _lose(lost)
        time.sleep(3)
        new = c.add_node()
        job.start(new, name="replacement")
        evs = job.assert_recovered(ref, killed=(f"agent{lost.index}",))
        fetched = [e for e in job.events("replacement") if e["event"] == "replica_fetched"]
        # straight from a surviving node's agent to the replacement's listener, not through the store
        assert fetched and all(e["via"] == "stream" for e in fetched), job.logs()
        dec = next(e for e in evs if e["event"] == "restore_decision")
        assert dec["lost"], dec
        # from evidence (its agent stopped beating), not torch's keep-alive expiry
        assert any(e["event"] == "node_lost" for e in evs), job.logs()


@pytest.mark.parametrize("nnodes,nproc", B)
def test_node_lost_with_hot_spare(nnodes, nproc, mn_reference):
    """A spare agent waits from the start; its arrival restarts nothing."""
    ref = mn_reference(nnodes, nproc, STEPS)
    with Cluster(nnodes) as c:
        lost = c.nodes[nnodes - 1]
        job = Job(c, nproc, STEPS, timeout_s=PAUSED)
        job.start_all(env_of=_stop_on(job, lost))
        # the job's round is complete (else the spare could take a node's place in it)
        job.wait_for_output("agent0", "step    0")
        spare = c.add_node()
        job.start(spare, name="spare")
        job.wait_spare()
        assert "restart" not in job.procs["agent0"].output(), job.logs()
        _lose(lost)
        evs = job.assert_recovered(ref, killed=(f"agent{lost.index}",))
        rdzv = [e for e in evs if e["event"] == "rendezvous"]
        assert max(e["round"] for e in rdzv) == 1, "the spare's arrival alone caused no round"
        assert any(e["event"] == "node_lost" for e in evs), job.logs()
        assert any(e["event"] == "loaded" for e in job.events("spare")), job.logs()


def test_slow_node_returns_and_changes_nothing(mn_reference):
    """A whole node (agent and workers) stopped past detection, then
    continued: the job went on with the spare without waiting for the
    keep-alive expiry, and the returning node changes nothing: its agent says
    it was taken as lost and exits 1 without closing the job's rendezvous; the
    result is bit-identical."""
    steps = 160
    ref = mn_reference(2, 2, steps)
    with Cluster(2) as c:
        job = Job(c, 2, steps, train=["--step-sleep", "0.1"])
        job.start_all()
        job.wait_for_output("agent0", "step    0")
        spare = c.add_node()
        job.start(spare, name="spare")
        job.wait_spare()
        stopped = c.nodes[1].kill(signal.SIGSTOP)
        t0 = time.monotonic()
        job.wait_for_output("agent0", "taken as lost", timeout=60)
        detected = time.monotonic() - t0
        time.sleep(detected)  # stopped for twice the time its loss took to be seen
        assert "trained" not in job.procs["agent0"].output(), "training too short for this test"
        signal_all(stopped, signal.SIGCONT)
        codes = job.wait()
        assert codes == {"agent0": 0, "agent1": 1, "spare": 0}, f"exit codes {codes}\n{job.logs()}"
        assert "was taken as lost by the job" in job.procs["agent1"].output(), job.logs()
        assert any(e["event"] == "node_evicted" for e in job.events("agent1")), job.logs()
        evs = [e for n in ("agent0", "spare") for e in job.events(n)]
        recs = [e for e in evs if e["event"] == "recovery"]
        assert len(recs) == 1 and recs[0]["redone_minibatches"] <= 1, recs
        detected_ev = [e for e in evs if e["event"] == "hang_detected"]
        # from the silent agent, not the ceiling (--jit-timeout)
        assert detected_ev and "stopped answering" in detected_ev[0]["why"], detected_ev
        assert_same_state(ref, job.out)


def test_lost_collective_across_nodes_is_found_from_the_agents_word(mn_reference):
    """Every rank, on both nodes, waits in a collective nobody completes: each
    agent sees only a laggard elsewhere, posts its suspicion, and the one that
    holds the other's word for the same collective (none computing) confirms a
    lost collective in about a bound, not at the ceiling (60 s here)."""
    ref = mn_reference(2, 1, STEPS)
    with Cluster(2) as c:
        job = Job(c, 1, STEPS, timeout_s=60)
        lose = ";".join(f"rank={r},step=9,phase=forward,kind=lose" for r in range(2))
        job.start_all(env={"JITCKPT_FAULT": lose})
        evs = job.assert_recovered(ref)
        det = [e for e in evs if e["event"] == "hang_detected"]
        assert det and det[0]["kind"] == "lost" and "agents' word" in det[0]["why"], det
        assert det[0]["waiting"] and max(det[0]["waiting"].values()) < 30, det  # far below the ceiling


def test_spare_exits_with_the_jobs_outcome(mn_reference):
    """A hot spare that waits through a job that never fails exits 0 with it:
    the agent hosting the rendezvous store keeps it up until the waiting spare
    has read the outcome."""
    ref = mn_reference(2, 1, STEPS)
    with Cluster(3) as c:
        # long enough for the spare's agent to start and wait on a loaded machine
        job = Job(c, 1, STEPS, nnodes=2, train=["--step-sleep", "0.5"])
        job.start_all()
        job.wait_for_output("agent0", "step    0")
        spare = c.nodes[2]
        job.start(spare, name="spare")
        job.wait_spare()
        assert "trained" not in job.procs["agent0"].output(), "training too short for this test"
        codes = job.wait(timeout=240)
        assert codes == {"agent0": 0, "agent1": 0, "spare": 0}, f"exit codes {codes}\n{job.logs()}"
        assert "finished while this node waited" in job.procs["spare"].output(), job.logs()
        assert_same_state(ref, job.out)


def test_forced_divergence_is_refused(mn_reference):
    """One rank made to load an older step than the job's: refused before any
    training step, loudly, and never restarted."""
    with Cluster(2) as c:
        job = Job(c, 1, STEPS)
        # first failure at step 5 (a replica of step 5), second at 12; on the
        # restart after it rank 1 loads step 5 instead of 12
        spec = ("rank=1,step=5,phase=backward,kind=sigkill;rank=1,step=12,phase=backward,kind=sigkill,attempt=1;"
                "rank=1,phase=restore,kind=stale,attempt=2")
        job.start_all(env={"JITCKPT_FAULT": spec})
        codes = job.wait()
        assert all(code != 0 for code in codes.values()), codes
        evs = job.all_events()
        div = [e for e in evs if e["event"] == "state_divergence"]
        assert div, job.logs()
        # the whole output: logs() keeps only a tail, which the refusal's later lines can push out
        full = "\n".join(p.output() for p in job.procs.values())
        assert "loaded different checkpoints" in full and "REFUSING TO TRAIN" in full, job.logs()
        assert any(e["event"] == "job_abort" for e in evs)
        last = _round_start(evs, 2)
        assert not [e for e in evs if e["event"] == "resumed" and e["t"] >= last], "no training step taken"
        assert not [e for e in evs if e["event"] == "restart" and e["t"] >= last], "not restarted"


def test_corrupt_transfer_is_retried_from_another_source(mn_reference):
    ref = mn_reference(3, 1, STEPS)
    with Cluster(3) as c:
        job = Job(c, 1, STEPS)
        # nodes 0 and 1 both save; node 0 (the first source) serves a corrupted copy
        job.start_all(env=_fault(2, "sigkill"), env_of={0: {"JITCKPT_TEST_CORRUPT_TRANSFER": "1"},
                                                         1: {"JITCKPT_TEST_CORRUPT_TRANSFER": ""}})
        evs = job.assert_recovered(ref)
        fails = [e for e in evs if e["event"] == "replica_fetch_failed"]
        got = [e for e in evs if e["event"] == "replica_fetched"]
        assert fails and "verification" in fails[0]["error"], evs
        assert got and got[0]["source"].startswith(c.nodes[1].addr), got
        assert got[0]["via"] == "stream" and not [e for e in evs if e["event"] == "replica_fetch_fallback"], evs


CATCHING = Path(__file__).with_name("catchers") / "try_exit.py"  # logs any exception and exits 1


@pytest.fixture(scope="module")
def catching_reference(tmp_path_factory) -> Path:
    """The catching script's failure-free run: plain torchrun, 2 ranks on one node."""
    tmp = tmp_path_factory.mktemp("ref-try-exit")
    out = tmp / "reference.pt"
    cp = run_reference([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(CATCHING), "--out", str(out), "--epochs", "3"], cwd=tmp, timeout=300)
    assert cp.returncode == 0, cp.stdout[-3000:]
    return out


@pytest.mark.parametrize("lost", ["rank", "node"])
def test_catching_script_across_nodes(lost, catching_reference):
    """A script that catches every exception and exits 1 (``try: main() except
    Exception: sys.exit(1)``), one rank per node: the rank on node 1 is killed
    inside a minibatch, or the whole of node 1 vanishes while its rank is stopped
    before a minibatch's first collective and a hot spare waits. Node 0's rank
    saves where torch raises, before the script's ``except`` runs, and the job
    ends bit-identical to the failure-free run."""
    with Cluster(2) as c:
        # the script writes where Job.out is (the cluster's final.pt); a stopped rank is only the
        # moment of the node's loss: the ceiling must not fire first
        job = Job(c, 1, 0, script=[str(CATCHING), "--out", str(c.dir / "final.pt"), "--epochs", "3"],
                  timeout_s=5 if lost == "rank" else PAUSED)
        killed: tuple[str, ...] = ()
        if lost == "rank":
            job.start_all(env={"JITCKPT_FAULT": "rank=1,step=10,phase=backward,kind=sigkill"})
        else:
            job.start_all(env_of=_stop_on(job, c.nodes[1], step=10))
            # node 1's rank stopped at step 10: the round is the two nodes' (a spare started
            # before it formed could take node 1's place in it)
            _stopped_worker(c.nodes[1])
            spare = c.add_node()
            job.start(spare, name="spare")
            job.wait_spare()
            _lose(c.nodes[1])
            killed = ("agent1",)
        evs = job.assert_recovered(catching_reference, killed=killed)
        text = job.logs()
        assert "training failed" not in text and "Traceback" not in text, text  # no except ever ran
        first = next(e for e in evs if e["event"] == "restart")
        exits = {e["rank"]: e["exitcode"] for e in evs[:evs.index(first)] if e["event"] == "worker_exit"}
        saved = [(e["rank"], e["step"]) for e in evs if e["event"] == "checkpoint_saved"]
        if lost == "rank":  # rank 0 saved (75) before any except; rank 1 died of its SIGKILL
            assert exits == {0: EXIT_SAVED, 1: -9}, (exits, text)
            assert saved == [(0, 10)], (saved, text)
        else:  # node 0's rank (the rendezvous chose which) saved; node 1's timeline went with its node
            assert list(exits.values()) == [EXIT_SAVED] and saved == [(next(iter(exits)), 10)], (exits, saved, text)
            assert any(e["event"] == "node_lost" for e in evs), text
            assert any(e["event"] == "loaded" for e in job.events("spare")), text


def test_lost_node_without_replacement_ends_clearly():
    with Cluster(2) as c:
        job = Job(c, 1, LONG, train=["--step-sleep", "0.05"], rdzv_conf="join_timeout=8")
        job.start_all()
        job.wait_for_output("agent0", "step   10")
        c.nodes[1].kill()
        codes = job.wait(timeout=120, killed=("agent1",))
        assert codes["agent0"] != 0
        out = job.procs["agent0"].output()
        assert "lost node was not replaced" in out and "join_timeout" in out, out[-2000:]
        assert "Traceback" not in out.split("jitrun timeline")[0][-1500:]
