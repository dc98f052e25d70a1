"""Every shell command in README.md and docs/*.md is run, here or by the test it names.

Each ``sh``/``bash`` block starts with ``# run by WHO``: ``tests/test_docs.py``
(this file runs the block, in order with the other blocks of its page, in a
scratch directory holding ``train.py`` = scripts/demo_train.py and links to the
virtual environment and the build), ``tests/FILE.py::TEST`` (that test runs
it; checked to exist), or ``make demo``/CI (checked against the Makefile and
.ci/run). A block without the line fails this test: a command nobody runs
rots."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TRAIN

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```(sh|bash|shell|console)\n(.*?)```", re.S)
RUN_BY = re.compile(r"^# run by (\S+)")


def blocks(page: Path) -> list[tuple[str, str]]:
    """(who runs it, the block's text) for every shell block of ``page``."""
    out = []
    for m in BLOCK.finditer(page.read_text()):
        text = m.group(2)
        who = RUN_BY.match(text.split("\n", 1)[0])
        out.append((who.group(1) if who else "", text))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_says_who_runs_it(page: Path) -> None:
    for who, text in blocks(page):
        assert who, f"{page.name}: a shell block without '# run by ...':\n{text}"
        if who.startswith("tests/") and "::" in who:
            path, name = who.split("::", 1)
            assert (ROOT / path).is_file(), f"{page.name}: {path} does not exist"
            assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), \
                f"{page.name}: {path} has no test {name}"
        elif who == "make":
            makefile = (ROOT / "Makefile").read_text()
            for target in re.findall(r"^make (\S+)", text, re.M):
                assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"no make target {target}"
            assert "make test" in (ROOT / ".ci" / "run").read_text()
        else:
            assert who == "tests/test_docs.py", f"{page.name}: unknown runner {who!r}"


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if any(w == "tests/test_docs.py" for w, _ in blocks(p))],
                         ids=lambda p: p.name)
def test_blocks_run(page: Path, tmp_path: Path) -> None:
    shutil.copy(TRAIN, tmp_path / "train.py")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    (tmp_path / "build").symlink_to(ROOT / "build")
    env = {**os.environ, "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1"}
    for who, text in blocks(page):
        if who != "tests/test_docs.py":
            continue
        cp = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", text], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300, start_new_session=True)
        assert cp.returncode == 0, f"{page.name}: exit {cp.returncode}\n{text}\n{cp.stdout[-3000:]}{cp.stderr[-3000:]}"
