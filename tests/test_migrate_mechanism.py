"""CRIU migration of a real torch gloo rank (the mechanism under `jitrun migrate`).

Two ranks train with a gloo process group over a TCPStore that neither of them
hosts (the test, or a store process on node 0, does: as jitrun's agent does).
At a step boundary every rank runs jitckpt.migrate_worker.pause: destroy the
group and release it (gloo threads, listener, pairs), close the store client,
announce ``paused-1.json``, poll for ``resume-1.json``. Rank 1 is dumped by
CRIU (images checksummed), restored (on the same node, then on another network
namespace node with its own mount namespace), and both ranks rebuild their
store client and group under a new store prefix. The final parameters equal a
run without migration bit for bit, and the script's initialisation ran once.

Needs root and a working criu (`make criu`); skips with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from netns import CRIU_RESTORE_ON_NODE, Cluster, MigratableProcs, copy_dir, wait_for_line

from jitckpt.wire import auth, contract
from jitrun.migration import criu

ROOT = Path(__file__).resolve().parent.parent
STEPS = 30
PAUSE_AT = 12

WORKER = textwrap.dedent('''
    import hashlib, json, os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from jitckpt import migrate_worker as mw

    ctl, host = sys.argv[1], sys.argv[4]
    rank, world = int(sys.argv[2]), int(sys.argv[3])
    port, steps, pause_at = map(int, sys.argv[5:8])
    torch.set_num_threads(1)
    mine = os.path.join(ctl, f"rank{rank}")
    os.makedirs(mine, exist_ok=True)
    with open(os.path.join(mine, "init.txt"), "a") as f:  # the initialisation counter
        f.write(f"{os.getpid()}\\n")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen_data = torch.Generator().manual_seed(100 + rank)
    stores = [dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)]
    dist.init_process_group("gloo", store=dist.PrefixStore("g0", stores[0]), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    ddp = os.environ.get("MIG_DDP") == "1"  # the model under DDP (its reducer holds the group)
    fwd = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    gen = 0
    token = os.environ.get("MIG_TOKEN")  # store-driven: jitrun.migration.control.request from outside
    watch = mw.Watch(stores[0], token) if token else None
    for step in range(steps):
        if watch is not None:  # the runtime's minibatch start
            got = mw.at_minibatch_start(watch, rank, world, ctl, step=step, stores=stores)
            if got is not None:
                gen, _, new_store, watch = got
                if new_store is not None:
                    stores = [new_store]
        if step == pause_at:  # a step boundary: nothing in flight
            gen += 1
            resume, s = mw.pause(mine, gen, rank, world, step=step, extra_stores=stores)
            stores = [s]
        x = torch.randn(16, 32, generator=gen_data)
        y = x.sum(1, keepdim=True).sin()
        loss = ((fwd(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters() if not ddp else ():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        with open(os.path.join(mine, "steps.txt"), "a") as f:
            f.write(f"{step} {loss.item():.9e} gen={gen} pid={os.getpid()}\\n")
        time.sleep(float(os.environ.get("MIG_SLEEP", "0.02")))
    h = hashlib.sha256()
    for t in [*model.parameters(), *(opt.state[p]["momentum_buffer"] for p in model.parameters())]:
        h.update(t.detach().numpy().tobytes())
    mw.write_json(__import__("pathlib").Path(mine, "final.json"), {"sha256": h.hexdigest(), "gen": gen})
    sys.stdout.flush()
    os._exit(0)  # no process-group destructor at exit (see jitckpt._bootstrap)
''')


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_file(p: Path, timeout: float, alive=None) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return json.loads(p.read_text())
        except (FileNotFoundError, ValueError):
            pass
        if alive is not None:
            alive()
        assert time.monotonic() < deadline, f"no {p} within {timeout}s"
        time.sleep(0.02)


def _steps(ctl: Path, rank: int) -> list[str]:
    p = ctl / f"rank{rank}" / "steps.txt"
    return p.read_text().splitlines() if p.exists() else []


def _losses(ctl: Path, rank: int) -> list[str]:
    return [" ".join(ln.split()[:2]) for ln in _steps(ctl, rank)]


class Local(MigratableProcs):
    """Python workers on this host (the repo on PYTHONPATH), output to their own files."""

    def start(self, args: list[str], log: Path, env: dict | None = None) -> tuple[subprocess.Popen, int]:
        return super().start([sys.executable, *args], output=log,
                             env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.fixture
def local():
    lp = Local()
    yield lp
    lp.cleanup()


def _reference(tmp: Path, local: Local, env: dict | None = None) -> dict[int, str]:
    """The same two ranks without any pause: final hashes per rank."""
    import torch.distributed as dist

    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    ctl = tmp / f"ref{len(list(tmp.glob('ref*')))}"
    ctl.mkdir()
    script = tmp / "worker.py"
    script.write_text(WORKER)
    ps = [local.start([str(script), str(ctl), str(r), "2", "127.0.0.1", str(port), str(STEPS), "-1"],
                      tmp / f"{ctl.name}-{r}.log", env=env)[0] for r in range(2)]
    for p in ps:
        assert p.wait(timeout=180) == 0, [(tmp / f"{ctl.name}-{r}.log").read_text() for r in range(2)]
    del server
    return {r: json.loads((ctl / f"rank{r}" / "final.json").read_text())["sha256"] for r in range(2)}, ctl


def _wait_exit(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    raise AssertionError(f"PID {pid} still running after {timeout}s")


def test_gloo_rank_migrates_on_same_node(criu_bin, local, subreaper, tmp_path):
    pytest.importorskip("torch")
    import torch.distributed as dist

    ref, ref_ctl = _reference(tmp_path, local)
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    ctl = tmp_path / "mig"
    ctl.mkdir()
    script = tmp_path / "worker.py"
    started = [local.start([str(script), str(ctl), str(r), "2", "127.0.0.1", str(port), str(STEPS), str(PAUSE_AT)],
                           tmp_path / f"mig{r}.log") for r in range(2)]

    def alive():
        for r, (p, _) in enumerate(started):
            assert p.poll() is None, (tmp_path / f"mig{r}.log").read_text()

    paused = [_wait_file(ctl / f"rank{r}" / "paused-1.json", 120, alive) for r in range(2)]
    for inv in paused:
        # teardown released gloo and the store: no inet socket, no gloo thread left
        assert inv["inet_socket_fds"] == [], inv
        assert inv["step"] == PAUSE_AT
    outer, pid = started[1]
    res = criu.dump(pid, tmp_path / "images")
    outer.wait(timeout=10)
    criu.verify(tmp_path / "images")
    t0 = time.monotonic()
    new_pid = criu.restore(tmp_path / "images")
    restore_s = time.monotonic() - t0
    local.pids.append(new_pid)
    for r in range(2):
        resume = {"gen": 1, "store": ["127.0.0.1", port], "prefix": "g1"}
        (ctl / f"rank{r}" / "resume-1.json").write_text(json.dumps(resume))
    assert started[0][0].wait(timeout=120) == 0, (tmp_path / "mig0.log").read_text()
    assert _wait_exit(new_pid, 120) == 0
    del server
    for r in range(2):
        final = json.loads((ctl / f"rank{r}" / "final.json").read_text())
        assert final == {"sha256": ref[r], "gen": 1}, r
        assert len((ctl / f"rank{r}" / "init.txt").read_text().splitlines()) == 1, "initialised once"
        assert _losses(ctl, r) == _losses(ref_ctl, r)
    print(f"paused inventories {paused}; dump {res.seconds:.3f}s ({res.image_bytes / 1e6:.1f} MB), "
          f"restore {restore_s:.3f}s")


# On a node: host the job's store (as jitrun's agent on node 0 does).
NODE_STORE = textwrap.dedent('''
    import sys, time
    import torch.distributed as dist
    s = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False)
    print("STORE", flush=True)
    time.sleep(600)
''')

# On the source node: start the worker migratable, dump it once it has paused, keep the images.
NODE_DUMP = textwrap.dedent('''
    import os, subprocess, sys, time
    from jitrun.migration import criu
    paused, images, log, *cmd = sys.argv[1:]
    p = subprocess.Popen(criu.migratable_command(cmd, output=log), stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid = criu.ns_init_pid(p.pid)
    print(f"STARTED {pid}", flush=True)
    while not os.path.exists(paused):
        if p.poll() is not None:
            sys.exit(f"worker exited {p.returncode}")
        time.sleep(0.02)
    res = criu.dump(pid, images)
    p.wait()
    print(f"DUMPED {res.seconds:.3f} {res.image_bytes}", flush=True)
    time.sleep(600)  # keep this mount namespace (and the images on its tmpfs) for the copy
''')


def test_gloo_rank_migrates_to_another_node(criu_bin, local, tmp_path):
    """rank 0 on node 0 (with the store), rank 1 starts on node 1 and moves to node 2.
    Every node's images dir is its own tmpfs; the copy goes through the host."""
    pytest.importorskip("torch")
    why = Cluster.unavailable()
    if why:
        pytest.skip(why)
    ref, ref_ctl = _reference(tmp_path, local)
    port = 29611
    with Cluster(3, tag="mg") as c:
        share = c.dir  # the control dir and the worker logs, seen by every node at the same path
        for name, text in (("worker.py", WORKER), ("store.py", NODE_STORE), ("dump.py", NODE_DUMP),
                           ("restore.py", CRIU_RESTORE_ON_NODE)):
            (share / name).write_text(text)
        ctl = share / "ctl"
        ctl.mkdir()
        host = c.nodes[0].addr
        env = {"PYTHONPATH": str(ROOT), contract.CRIU.name: criu_bin, "GLOO_SOCKET_IFNAME": "eth0",
               "OMP_NUM_THREADS": "1"}
        store = c.nodes[0].run([sys.executable, str(share / "store.py"), host, str(port)], name="store", env=env)
        wait_for_line(store, "STORE", 60)

        def args(r):
            return [sys.executable, str(share / "worker.py"), str(ctl), str(r), "2", host, str(port), str(STEPS),
                    str(PAUSE_AT)]

        rank0 = c.nodes[0].run(args(0), name="rank0", env=env)
        priv1, priv2 = str(tmp_path / "node1"), str(tmp_path / "node2")
        dumper = c.nodes[1].run([sys.executable, str(share / "dump.py"), str(ctl / "rank1" / "paused-1.json"),
                                 priv1 + "/images", str(share / "rank1.log"), *args(1)],
                                name="dump", env=env, private_dirs=(priv1,))
        restorer = c.nodes[2].run([sys.executable, str(share / "restore.py"), priv2 + "/images"],
                                  name="restore", env=env, private_dirs=(priv2,))
        dumped = wait_for_line(dumper, "DUMPED", 180)
        paused = [json.loads((ctl / f"rank{r}" / "paused-1.json").read_text()) for r in range(2)]
        assert all(p["inet_socket_fds"] == [] for p in paused), paused
        assert not Path(priv1, "images").exists(), "node 1's images are on its own tmpfs"
        copy_dir(dumper, priv1 + "/images", restorer, priv2 + "/images")
        restorer.host_path(priv2 + "/images/copied").touch()
        restored = wait_for_line(restorer, "RESTORED", 60)
        for r in range(2):
            resume = {"gen": 1, "store": [host, port], "prefix": "g1", "env": {"GLOO_SOCKET_IFNAME": "eth0"}}
            (ctl / f"rank{r}" / "resume-1.json").write_text(json.dumps(resume))
        assert wait_for_line(restorer, "EXIT", 120) == "EXIT 0", (share / "rank1.log").read_text()[-3000:]
        assert rank0.wait(timeout=120) == 0, rank0.output()[-3000:]
        for r in range(2):
            final = json.loads((ctl / f"rank{r}" / "final.json").read_text())
            assert final == {"sha256": ref[r], "gen": 1}, r
            assert len((ctl / f"rank{r}" / "init.txt").read_text().splitlines()) == 1, "initialised once"
            assert _losses(ctl, r) == _losses(ref_ctl, r)
        print(f"node1 -> node2: {dumped}, {restored}")


def test_destroyed_but_kept_group_still_holds_sockets_until_teardown(tmp_path):
    """What breaks without teardown: ``destroy_process_group()`` while a reference lives
    on (jitckpt._bootstrap keeps every destroyed group, a DDP reducer holds one) leaves
    gloo's listener, pairs and threads in the process; a dump then carries sockets bound
    to this node's address. migrate_worker.teardown lets go of them."""
    pytest.importorskip("torch")
    code = textwrap.dedent('''
        import json, sys
        from datetime import timedelta
        import torch, torch.distributed as dist
        from jitckpt import _bootstrap, migrate_worker as mw
        _bootstrap._keep_groups()
        stores = [dist.FileStore(sys.argv[1], 1)]  # no socket of its own: only gloo's are counted
        before = mw.inventory()
        dist.init_process_group("gloo", store=dist.PrefixStore("g0", stores[0]), rank=0, world_size=1,
                                timeout=timedelta(seconds=30))
        t = torch.ones(3); dist.all_reduce(t)
        dist.destroy_process_group()   # what a script does; _bootstrap keeps the group
        kept = mw.inventory()
        after = mw.teardown(stores)
        print(json.dumps({"before": before, "kept": kept, "after": after, "n_kept": len(_bootstrap._kept)}))
        sys.stdout.flush()
        import os; os._exit(0)
    ''')
    cp = subprocess.run([sys.executable, "-c", code, str(tmp_path / "filestore")], capture_output=True, text=True,
                        timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert cp.returncode == 0, cp.stderr
    got = json.loads(cp.stdout.strip().splitlines()[-1])
    assert got["before"]["inet_socket_fds"] == [], got
    assert got["kept"]["inet_socket_fds"], got  # gloo's listener and pair are still open
    assert got["kept"]["threads"] > got["before"]["threads"], got  # and its threads run
    assert got["after"]["inet_socket_fds"] == [] and got["n_kept"] == 0, got
    assert got["after"]["threads"] <= got["before"]["threads"], got


@pytest.mark.parametrize("ddp", [False, True], ids=["allreduce", "ddp"])
def test_store_request_pauses_every_rank_at_its_next_minibatch_start(criu_bin, local, subreaper, tmp_path, ddp):
    """The `jitrun migrate` protocol (jitrun.migration.control.request through the job's store):
    each rank sees the request at a minibatch start (migrate_worker.Watch, one store
    add per minibatch); the peer tears its group down and keeps its store client,
    the moving rank closes its store client too, is dumped and restored, and all
    rebuild under the migration's prefix. Zero minibatches redone."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    from jitrun.migration import control as migrate

    ref, ref_ctl = _reference(tmp_path, local, env={"MIG_DDP": str(int(ddp))})
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    ctl = tmp_path / "mig"
    ctl.mkdir()
    script = tmp_path / "worker.py"
    env = {"MIG_TOKEN": "tok", "MIG_SLEEP": "0.1", "MIG_DDP": str(int(ddp))}
    started = [local.start([str(script), str(ctl), str(r), "2", "127.0.0.1", str(port), str(STEPS), "-1"],
                           tmp_path / f"mig{r}.log", env=env) for r in range(2)]
    deadline = time.monotonic() + 120
    while len(_steps(ctl, 0)) < 5:
        assert time.monotonic() < deadline and all(p.poll() is None for p, _ in started), \
            [(tmp_path / f"mig{r}.log").read_text() for r in range(2)]
        time.sleep(0.02)
    gen = migrate.request(server, "tok", rank=1, to="self")
    paused = _wait_file(ctl / "rank1" / f"paused-{gen}.json", 60)
    assert paused["inet_socket_fds"] == [], paused  # no store connection, no gloo socket
    deadline = time.monotonic() + 60
    while migrate.paused_ranks(server, "tok", gen, 2) != [0, 1]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    k = migrate.key("tok", gen, "paused", 0)
    peer, why = auth.of("tok").unseal(k, server.get(k))  # a record sealed under the job token
    assert why is None, why
    assert peer["step"] == paused["step"] < STEPS, (peer, paused)  # the same minibatch start
    outer, pid = started[1]
    criu.dump(pid, tmp_path / "images")
    outer.wait(timeout=10)
    new_pid = criu.restore(tmp_path / "images")
    local.pids.append(new_pid)
    # the target's agent: the moved rank's resume file; the peers: the store key
    body = migrate.resume(server, "tok", gen, f"m{gen}", ("127.0.0.1", port))
    (ctl / "rank1" / f"resume-{gen}.json").write_text(json.dumps(body))
    assert started[0][0].wait(timeout=120) == 0, (tmp_path / "mig0.log").read_text()
    assert _wait_exit(new_pid, 120) == 0
    del server
    print(f"ddp={ddp}: paused at step {paused['step']}, teardown {paused['teardown_s']}s, rebuild "
          f"{json.loads((ctl / 'rank1' / f'rebuilt-{gen}.json').read_text())['rebuild_s']}s")
    for r in range(2):
        final = json.loads((ctl / f"rank{r}" / "final.json").read_text())
        assert final == {"sha256": ref[r], "gen": gen}, r
        assert len((ctl / f"rank{r}" / "init.txt").read_text().splitlines()) == 1, "initialised once"
        steps = [int(ln.split()[0]) for ln in _steps(ctl, r)]
        assert steps == list(range(STEPS)), "every minibatch exactly once: none redone"
        assert _losses(ctl, r) == _losses(ref_ctl, r)


def test_every_rank_pauses_at_the_same_minibatch_start_whenever_it_saw_the_request():
    """The race a whole-node migration hit under load: rank 0 polled at the start
    of step 5 just before the request came, rank 1 just after. Had rank 1 paused at
    5 it would have torn its group down under rank 0's step-5 collectives. The
    first rank to see the request fixes the pause at the next step for all; a rank
    that sees it only past that step (no per-step collectives) pauses at once."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    from jitckpt import migrate_worker as mw
    from jitrun.migration import control as migrate

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    w0, w1, w2 = (mw.Watch(server, "tok") for _ in range(3))
    assert w0.poll(5) is None  # rank 0 is into step 5
    gen = migrate.request(server, "tok", rank=1, to="x")
    assert w1.poll(5) is None, "rank 1 must not pause where rank 0 already runs on"
    assert w1.poll(6)[0] == gen
    assert w0.poll(6)[0] == gen
    assert w2.poll(9)[0] == gen  # far past the pause step: at once
    assert w0.poll(7) is None and w1.poll(7) is None  # once per request
    gen2 = migrate.request(server, "tok", rank=0, to="x")
    assert w1.poll(7) is None and w1.poll(8)[0] == gen2
