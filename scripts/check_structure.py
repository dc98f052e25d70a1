"""The code's shape, checked in `make test`: no module of jitckpt/ or
launcher/ over MAX_FILE lines, no function over MAX_FUNC lines, no
import cycle between the modules of either package (imports inside
functions count: a cycle hidden that way is still a cycle), and one
import name for the launcher package: ``jitrun`` (its directory's name,
``launcher``, imports only from a checkout's root and would load every
module a second time beside the installed ``jitrun`` ones), and every
sub-package listed in pyproject.toml's packages (an editable install finds
one that is not; a wheel leaves it out)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"jitckpt": ROOT / "jitckpt", "jitrun": ROOT / "launcher"}
MAX_FILE = 600
MAX_FUNC = 60
# the one module that touches torch's private names and patches torch's objects
COMPAT = ROOT / "jitckpt" / "torch_compat"
# where Python code that imports the packages lives
SOURCES = ("jitckpt", "launcher", "scripts", "tests")


def modules() -> dict[str, Path]:
    out = {}
    for pkg, d in PACKAGES.items():
        for p in sorted(d.rglob("*.py")):
            rel = p.relative_to(d).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def imports(name: str, path: Path, tree: ast.AST, known: set[str]) -> set[str]:
    """The package modules ``name`` imports, anywhere in its body."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")
                base = ".".join(up[: len(up) - node.level + 1] + ([base] if base else []))
            # "from pkg import mod" depends on mod; "from mod import name" on mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def launcher_imports() -> list[str]:
    """Imports of the launcher package by its directory's name, not ``jitrun``."""
    out = []
    for d in SOURCES:
        for p in sorted((ROOT / d).rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                out += [f"{p.relative_to(ROOT)}:{node.lineno}: imports {n!r}: import it as 'jitrun'"
                        for n in names if n == "launcher" or n.startswith("launcher.")]
    return out


def _torch_names(tree: ast.AST) -> set[str]:
    """Names bound to torch's modules or objects: imports, and ``sys.modules["torch..."]``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript):
            v = node.value
            if ast.unparse(v.value) == "sys.modules" and ast.unparse(v.slice).strip("'\"").startswith("torch"):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_names(paths) -> set[str]:
    """Every name jitckpt and jitrun define or bind (functions, classes, attributes they
    assign, variables, parameters): a private attribute by another name is someone else's."""
    names = set()
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    # the attributes jitckpt puts on others' objects are no names of its own
    return {n for n in names if not n.startswith("_jitckpt")}


# the standard library's private names that are its public API (sys._getframe, os._exit)
STDLIB_ROOTS = {"os", "sys", "threading", "ctypes", "signal", "socket", "io", "mmap", "gc", "inspect", "atexit"}


def torch_internals(path: Path, tree: ast.AST, ours: set[str]) -> list[str]:
    """Private torch names and patches of torch's objects in ``path``: they belong in
    jitckpt/torch_compat/, where each says which torch versions it was checked against.
    Two nets: names rooted at a torch import (``c10d._world``, ``DDP.forward = ...``), and
    a private attribute of any object (``handler._state_holder``) that jitckpt and jitrun
    never define, read off anything but ``self``/``cls``. The integrations (Lightning,
    Accelerate, ...) are each their library's own door and are left to the second net's
    eyes only for torch's names."""
    torchy = _torch_names(tree)
    where = path.relative_to(ROOT)
    integration = "integrations" in path.parts
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not integration \
                and _root(node) not in torchy | STDLIB_ROOTS | {"self", "cls"} and node.attr not in ours:
            out.append(f"{where}:{node.lineno}: {ast.unparse(node)}: a private name of another library's object")
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            out += [f"{where}:{node.lineno}: imports torch's private {node.module}.{a.name}"
                    for a in node.names if _private(a.name) or any(map(_private, node.module.split(".")))]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and _root(node) in torchy:
            out.append(f"{where}:{node.lineno}: torch's private {ast.unparse(node)}")
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out += [f"{where}:{node.lineno}: patches torch's {ast.unparse(t)}" for t in targets
                    if isinstance(t, (ast.Attribute, ast.Subscript)) and _root(t) in torchy]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "getattr") \
                and node.args and _root(node.args[0]) in torchy:
            name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
            if node.func.id == "setattr" or (isinstance(name, str) and _private(name)):
                out.append(f"{where}:{node.lineno}: {node.func.id} on torch's {ast.unparse(node.args[0])}")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def unlisted_packages() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"([a-z_.]+)"', re.search(r"^packages = \[(.*)\]$", text, re.M).group(1)))
    out = []
    for pkg, d in PACKAGES.items():
        for init in sorted(d.rglob("__init__.py")):
            name = ".".join([pkg, *init.parent.relative_to(d).parts])
            if name not in listed:
                out.append(f"pyproject.toml: package {name} ({init.parent.relative_to(ROOT)}) is not in "
                           "[tool.setuptools] packages: a wheel would leave it out; add it")
    return out


def main() -> int:
    mods = modules()
    known = set(mods)
    problems = []
    graph: dict[str, set[str]] = {}
    ours = own_names(mods.values())
    for name, path in mods.items():
        text = path.read_text()
        n = text.count("\n")
        if n > MAX_FILE:
            problems.append(f"{path.relative_to(ROOT)}: {n} lines (at most {MAX_FILE})")
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNC:
                    problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} is {length} lines "
                                    f"(at most {MAX_FUNC})")
        graph[name] = {t for t in imports(name, path, tree, known) if t != name}
        if COMPAT not in path.parents:
            problems += torch_internals(path, tree, ours)
    # a package's __init__ importing its own modules is not a cycle of theirs
    for name in graph:
        graph[name] = {t for t in graph[name] if not (mods[name].name == "__init__.py" and t.startswith(name + "."))}
    for comp in cycles(graph):
        problems.append("import cycle: " + " <-> ".join(comp))
    problems += launcher_imports()
    problems += unlisted_packages()
    for p in problems:
        print(p)
    print(f"check_structure: {len(mods)} modules, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
