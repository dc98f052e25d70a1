"""The shim's module structure: calls and includes point down the layers
(watchdog -> recovery -> replay, never back; one header per layer, no include
circle), and jitckpt/intercept.py declares the control API from jitintercept.h
itself."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "shim_progs"))
import shimtest as st  # noqa: E402

SCRIPT = st.REPO / "scripts" / "check_shim_layers.py"
SRC = st.REPO / "libintercept" / "src"


def _check(src: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--src", str(src)], capture_output=True, text=True,
                          timeout=300)


def _copy(tmp_path: Path) -> Path:
    lib = tmp_path / "libintercept"
    shutil.copytree(st.REPO / "libintercept", lib, ignore=shutil.ignore_patterns("build"))
    return lib / "src"


def test_every_reference_between_modules_points_down() -> None:
    r = _check(SRC)
    assert r.returncode == 0, r.stderr
    assert "points down" in r.stdout


def test_a_call_back_up_is_reported(tmp_path: Path) -> None:
    """Negative control: recovery -> watchdog and replay -> recovery calls added
    to a copy of the sources are both named, and the check fails. A module's
    own header does not declare what lies above it, so each call comes with a
    prototype of its own (what the check on the object files still catches)."""
    src = _copy(tmp_path)
    with open(src / "shim_transparent.c", "a") as f:
        f.write("void ji_wd_start(void);\nvoid ji_up1(void);\nvoid ji_up1(void) { ji_wd_start(); }\n")
    with open(src / "shim_replay.c", "a") as f:
        f.write("void ji_rcv_check_peers(void);\nvoid ji_up2(void);\nvoid ji_up2(void) { ji_rcv_check_peers(); }\n")
    r = _check(src)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "shim_transparent (recovery) -> shim_watchdog (watchdog): ji_wd_start" in r.stderr
    assert "shim_replay (replay) -> shim_transparent (recovery): ji_rcv_check_peers" in r.stderr


def test_an_include_up_a_layer_is_reported(tmp_path: Path) -> None:
    """Negative control: a watchdog-layer module that includes the entry modules'
    header, and a base module that includes the replay layer's header instead of
    its own, are named, and the check fails (the sources still compile: only the
    include rule finds these)."""
    src = _copy(tmp_path)
    with open(src / "shim_watchdog.c", "a") as f:
        f.write('#include "shim_entry.h"\n')
    trigger = src / "shim_trigger.c"
    text = trigger.read_text()
    assert '#include "shim_base.h"' in text
    trigger.write_text(text.replace('#include "shim_base.h"', '#include "shim_replay.h"'))
    r = _check(src)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "shim_watchdog (watchdog) includes shim_entry.h (entry), a layer above its own" in r.stderr
    assert "shim_trigger (base) includes shim_replay.h (replay), a layer above its own" in r.stderr
    assert "shim_trigger (base) does not include shim_base.h, its layer's header" in r.stderr
    assert "3 include(s) and 0 reference(s) point up" in r.stderr


def test_an_include_circle_is_reported(tmp_path: Path) -> None:
    """Negative control: a layer's header that includes a higher layer's (a
    circle through three headers), and the neutral table that includes the
    base header (a circle the layer rule alone cannot see)."""
    src = _copy(tmp_path)
    with open(src / "shim_replay.h", "a") as f:
        f.write('#include "shim_watchdog.h"\n')
    with open(src / "shim_table.h", "a") as f:
        f.write('#include "shim_base.h"\n')
    r = _check(src)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "shim_replay.h (replay) includes shim_watchdog.h (watchdog), not a lower layer's header" in r.stderr
    circles = [line for line in r.stderr.splitlines() if line.startswith("include circle: ")]
    assert "include circle: shim_base.h -> shim_table.h -> shim_base.h" in circles, r.stderr
    assert "include circle: shim_watchdog.h -> shim_recovery.h -> shim_replay.h -> shim_watchdog.h" in circles, \
        r.stderr
    assert len(circles) == 2, r.stderr


def test_a_new_header_must_be_placed(tmp_path: Path) -> None:
    src = _copy(tmp_path)
    (src / "shim_misc.h").write_text("#pragma once\n")
    r = _check(src)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "shim_misc.h is no layer's header" in r.stderr


def test_a_new_module_must_be_placed(tmp_path: Path) -> None:
    src = _copy(tmp_path)
    (src / "shim_extra.c").write_text('#include "shim_base.h"\n')
    r = _check(src)
    assert r.returncode == 2
    assert "shim_extra.c is in no layer" in r.stderr


def test_no_issue_numbers_in_the_shim_or_its_binding() -> None:
    files = [*sorted(SRC.iterdir()), st.REPO / "jitckpt" / "intercept.py"]
    hits = [f"{p.name}:{i}" for p in files if p.is_file()
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"issue [0-9]", line)]
    assert hits == []


def _header_functions(text: str) -> set[str]:
    return set(re.findall(r"\b(jitintercept_\w+)\s*\(", re.sub(r"/\*.*?\*/", " ", text, flags=re.S)))


def test_python_binding_declares_the_header() -> None:
    """The cdef is the header's declarations (nothing copied by hand): in a
    process with the shim, the binding reaches every function jitintercept.h
    declares, and intercept.py calls none that the header lacks."""
    st.build()
    header = (st.REPO / "libintercept" / "include" / "jitintercept.h").read_text()
    declared = _header_functions(header)
    assert len(declared) > 20
    used = set(re.findall(r"lib\.(jitintercept_\w+)", (st.REPO / "jitckpt" / "intercept.py").read_text()))
    assert used and used <= declared, used - declared
    code = (
        "import json, sys\n"
        "from jitckpt import intercept\n"
        "lib = intercept._shim()\n"
        "names = json.loads(sys.argv[1])\n"
        "print(json.dumps({'header': str(intercept.HEADER), 'missing': [n for n in names if not hasattr(lib, n)]}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code, json.dumps(sorted(declared))],
                       env=st.env(leaks=False, PYTHONPATH=str(st.REPO)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(out["header"]) == st.REPO / "libintercept" / "include" / "jitintercept.h"
    assert out["missing"] == []
