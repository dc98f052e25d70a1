"""Warm restarts preload what the script imported: the record a worker writes
(jitckpt/import_record.py) and the second fork server that imports it (launcher/warm.py,
jitckpt/_warm_imports.py). One process and the servers it starts; no jitrun
(scripts/bench_hf_restart.py times it end to end)."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import stat
import sys
import time
import types

import pytest

from jitckpt import import_record
from jitrun import warm

SITE = import_record.site_dirs()[0]


def _mod(name: str, file: str | None) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__file__ = file
    return m


def test_record_keeps_installed_packages_in_load_order(tmp_path, monkeypatch):
    mods = {"zeta": _mod("zeta", f"{SITE}zeta/__init__.py"),
            "zeta.models.gpt": _mod("zeta.models.gpt", f"{SITE}zeta/models/gpt.py"),
            "alpha": _mod("alpha", f"{SITE}alpha.py"),
            "mymodel": _mod("mymodel", str(tmp_path / "mymodel.py")),  # the script's own directory
            "_private": _mod("_private", f"{SITE}_private.py"),
            "torch": _mod("torch", f"{SITE}torch/__init__.py"),  # the server preloads it already
            "json": _mod("json", os.path.dirname(json.__file__) + "/__init__.py"),  # the standard library
            "zeta.none": None}
    assert import_record.third_party(mods) == ["zeta", "zeta.models.gpt", "alpha"]
    # in a worker forked from the warm-start server: what the server had loaded is left out
    monkeypatch.setattr(import_record, "_inherited", frozenset({"zeta", "zeta.models.gpt"}))
    assert import_record.third_party(mods) == ["alpha"]


def test_record_file_and_validation(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("JITRUN_NO_WARM_IMPORTS", raising=False)
    import_record.at_training_start(tmp_path)
    path = tmp_path / import_record.FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "pytest" in import_record.load(tmp_path)  # this process's own installed packages
    path.write_text(json.dumps({"modules": ["ok.mod", "os; rm -rf", "../x", "_x", "a" * 200], "python": sys.version}))
    assert import_record.load(tmp_path) == ["ok.mod"]
    path.write_text(json.dumps({"modules": ["ok"], "python": "another"}))
    assert import_record.load(tmp_path) == []
    path.write_text("{garbage")
    assert import_record.load(tmp_path) == []
    import_record.record(tmp_path, ["ok.mod"])
    import_record.at_training_start(tmp_path)  # merged: the old names first, then this process's
    got = import_record.load(tmp_path)
    assert got[0] == "ok.mod" and "pytest" in got and len(got) == len(set(got))
    path.unlink()
    monkeypatch.setenv("LOCAL_RANK", "1")  # one record per node: local rank 0's
    import_record.at_training_start(tmp_path)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("JITRUN_NO_WARM_IMPORTS", "1")
    import_record.at_training_start(tmp_path)
    assert not path.exists()


def _probe(names: list[str]) -> None:
    # in the forked worker, before it imports anything itself; a blocked SIGTERM would keep it
    # from hearing the agent's save request
    if signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        os._exit(4)
    os._exit(0 if all(n in sys.modules for n in names) else 3)


def _children() -> set[int]:
    out: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            out |= {int(p) for p in f.read().split()}
    return out


@pytest.fixture
def servers(monkeypatch):
    """The forkserver module's functions and warm's state as they were; the servers started
    here stopped by PID."""
    for name in ("ensure_running", "connect_to_new_process", "get_inherited_fds", "set_forkserver_preload"):
        monkeypatch.setattr(multiprocessing.forkserver, name, getattr(multiprocessing.forkserver, name))
    monkeypatch.setattr(warm, "_next", None)
    monkeypatch.setattr(warm, "_using_next", False)
    monkeypatch.setattr(warm, "_record_seen", None)
    monkeypatch.setattr(warm, "_server_env", dict(os.environ))  # as if the first server had started
    monkeypatch.setattr(warm, "PRELOAD", ["jitckpt._server_bind"])  # not torch: seconds to import
    monkeypatch.delenv("JITRUN_NO_WARM_IMPORTS", raising=False)
    before = _children()
    yield
    for pid in _children() - before:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_next_attempt_forks_from_a_server_that_imported_the_record(tmp_path, servers):
    names = ["yaml", "idna.core"]  # installed here, not imported by the server's own preload
    assert warm.prepare_next(tmp_path) is None  # no record yet
    import_record.record(tmp_path, names + ["not_installed_pkg"])
    # spawned from a thread that has SIGTERM blocked, as jitrun's agent's was: the server
    # must not hand that mask to the workers it forks
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        assert warm.prepare_next(tmp_path) == names + ["not_installed_pkg"]
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    assert warm.prepare_next(tmp_path) is None  # once
    st = warm.use_next(wait_s=60)  # waits for the server's imports
    assert st is not None, "the preloading server never reported its imports"
    assert st["imported"] == 2 and st["skipped"] == ["not_installed_pkg"] and st["threads"] == 1
    p = multiprocessing.get_context("forkserver").Process(target=_probe, args=(names,))
    p.start()
    p.join(60)
    assert p.exitcode == 0  # the worker found them imported
    q = multiprocessing.get_context("forkserver").Process(target=_probe, args=(["jinja2"],))
    q.start()
    q.join(60)
    assert q.exitcode == 3  # not vacuous: what was not recorded is not there


def test_without_warm_start_or_when_off_nothing_starts(tmp_path, servers, monkeypatch):
    import_record.record(tmp_path, [])  # nothing beyond the first server's preload
    assert warm.prepare_next(tmp_path) is None and warm._next is None
    time.sleep(0.01)
    import_record.record(tmp_path, ["yaml"])
    monkeypatch.setenv("JITRUN_NO_WARM_IMPORTS", "1")
    assert warm.prepare_next(tmp_path) is None
    monkeypatch.delenv("JITRUN_NO_WARM_IMPORTS")
    monkeypatch.setattr(warm, "_server_env", None)  # --jit-warm-start off: fresh processes
    assert warm.prepare_next(tmp_path) is None and warm.use_next(wait_s=0) is None


def test_a_server_whose_imports_started_a_thread_is_not_used(servers, monkeypatch):
    """Its status says so (jitckpt/_warm_imports.py counts /proc/self/task): the restart forks
    from the first server; one that never answers is waited for only up to the bound."""
    before = multiprocessing.forkserver.connect_to_new_process
    monkeypatch.setattr(warm, "_next", types.SimpleNamespace(status_now=lambda: {"ok": False, "threads": 2}))
    assert warm.use_next(wait_s=5) is None
    monkeypatch.setattr(warm, "_next", types.SimpleNamespace(status_now=lambda: None))
    t0 = time.monotonic()
    assert warm.use_next(wait_s=0.3) is None and 0.25 < time.monotonic() - t0 < 5
    assert multiprocessing.forkserver.connect_to_new_process is before
