"""The code's shape, checked in `make test`: no module of jitckpt/ or
launcher/ over MAX_FILE lines, no function over MAX_FUNC lines, no
import cycle between the modules of either package (imports inside
functions count: a cycle hidden that way is still a cycle), and one
import name for the launcher package: ``jitrun`` (its directory's name,
``launcher``, imports only from a checkout's root and would load every
module a second time beside the installed ``jitrun`` ones)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"jitckpt": ROOT / "jitckpt", "jitrun": ROOT / "launcher"}
MAX_FILE = 600
MAX_FUNC = 60
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


def main() -> int:
    mods = modules()
    known = set(mods)
    problems = []
    graph: dict[str, set[str]] = {}
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
    # a package's __init__ importing its own modules is not a cycle of theirs
    for name in graph:
        graph[name] = {t for t in graph[name] if not (mods[name].name == "__init__.py" and t.startswith(name + "."))}
    for comp in cycles(graph):
        problems.append("import cycle: " + " <-> ".join(comp))
    problems += launcher_imports()
    for p in problems:
        print(p)
    print(f"check_structure: {len(mods)} modules, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
