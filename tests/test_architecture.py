"""Architecture rules, checked statically with ``ast`` (no first-party module is imported here).

1. No import cycle among the first-party packages ``libra``, ``baselines`` and ``experiments``
   (imports inside functions and under ``if TYPE_CHECKING:`` included).
2. The core (``libra/`` outside :data:`EXTENSIONS`) never imports an extension.
3. No function in ``libra/``, ``baselines/`` or ``experiments/`` longer than
   :data:`MAX_FUNCTION_LINES` lines, except the allow-listed ones (and an allow-list entry that no
   longer names a long function is itself an error).
4. No function in ``libra/``, ``baselines/`` or ``experiments/`` takes more than
   :data:`MAX_PARAMETERS` parameters (``self``/``cls`` not counted), except click entry points,
   compiled kernels (:data:`MAX_KERNEL_PARAMETERS`) and the allow-listed ones.
5. No production file names an issue number.
"""

from __future__ import annotations

import ast
import functools
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("libra", "baselines", "experiments")
MAX_FUNCTION_LINES = 80
LONG_FUNCTION_ALLOW: dict[str, str] = {  # path:function -> why it may exceed the limit
}
EXTENSIONS = "libra.extensions"
"""The package of extensions beyond the paper: the core reaches them only through its seams."""
MAX_PARAMETERS = 8
MAX_KERNEL_PARAMETERS = 12
"""A compiled kernel (``libra/jit/``) takes its arrays one by one, up to this many."""
MANY_PARAMETERS_ALLOW: dict[str, str] = {  # path:function -> why it may take more than MAX_PARAMETERS
}


# --------------------------------------------------------------------------- import graph


@functools.cache
def _parse(path: Path) -> ast.AST:
    """A source file's syntax tree, parsed once per test session (four scans read every file; none
    modifies a tree)."""
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``packages`` (``pkg/__init__.py`` is ``pkg``)."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _ancestors(name: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b"]`` (the packages whose ``__init__`` importing ``a.b.c`` runs first)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree``, at any depth: function bodies included (deferred imports run when the
    function is called) and ``if TYPE_CHECKING:`` bodies too (a type-only import still ties the two
    modules' designs together, so it may not close a cycle either)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([name] if name else [])])


def _imports(module: str, path: Path, known: set[str]):
    """``(target module, line, explicit)`` for every first-party import in ``path`` (see :func:`import_graph`)."""
    tree = _parse(path)
    is_package = path.name == "__init__.py"
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            src = (_resolve_relative(module, is_package, node.level, node.module) if node.level
                   else node.module)
            for alias in node.names:
                sub = f"{src}.{alias.name}"
                # ``from X import Y``: Y is the submodule X.Y when one exists, else an attribute of X
                yield (sub if sub in known else src), node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and isinstance(node.func.value, ast.Name)
              and node.func.value.id == "importlib" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.args[0].value, node.lineno  # importlib.import_module("a.b") with a literal name


def import_graph(root: Path, packages=PACKAGES) -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """Module-level import graph of the first-party packages.

    Edges from module ``m``:

    * to every first-party module ``m`` imports anywhere (module level, inside functions, inside
      ``try``, inside ``if TYPE_CHECKING:``); ``from X import Y`` targets ``X.Y`` when that is a
      module, else ``X`` (Y is an attribute, so X's code must have run); relative imports resolved;
    * implicitly, to the packages above each target (importing ``a.b.c`` runs ``a/__init__`` and
      ``a/b/__init__`` first), EXCEPT the packages above ``m`` itself: those are already being
      imported when ``m`` runs (``a/b/__init__`` importing ``a.b.c`` which imports ``a.b.d`` is no
      cycle through ``a/b/__init__``). An explicit import of such a package (``from a.b import name``
      where ``name`` is not a submodule) does count.

    Returns:
        ``(graph, where)``: ``graph[m]`` = modules ``m`` depends on; ``where[(m, t)]`` =
        ``"path:line"`` of the import that made the edge.
    """
    files = module_files(root, packages)
    known = set(files)
    graph: dict[str, set[str]] = {m: set() for m in files}
    where: dict[tuple[str, str], str] = {}
    for m, path in files.items():
        own = set(_ancestors(m))
        loc = path.relative_to(root).as_posix()
        for target, line in _imports(m, path, known):
            if target.split(".")[0] not in packages:
                continue
            while target not in known and "." in target:  # `import a.b.name` of a non-module: a.b
                target = target.rsplit(".", 1)[0]
            if target not in known:
                continue
            for t in [target, *(a for a in _ancestors(target) if a not in own and a in known)]:
                if t != m:
                    graph[m].add(t)
                    where.setdefault((m, t), f"{loc}:{line}")
    return graph, where


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; every node of ``graph`` and of its edge targets is placed."""
    nodes = sorted(set(graph) | {t for ts in graph.values() for t in ts})
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(sorted(comp))
    return out


def _shortest_path(graph, src: str, dst: str, allowed: set[str]) -> list[str]:
    prev, queue = {src: None}, deque([src])
    while queue:
        v = queue.popleft()
        if v == dst:
            path = []
            while v is not None:
                path.append(v)
                v = prev[v]
            return path[::-1]
        for w in sorted(graph.get(v, ())):
            if w in allowed and w not in prev:
                prev[w] = v
                queue.append(w)
    raise AssertionError(f"no path {src} -> {dst} inside its component")  # cannot happen in an SCC


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles of ``graph`` as closed chains ``[a, b, ..., a]``: for every edge ``u -> v`` inside a
    strongly connected component, the shortest cycle through it (duplicates dropped, rotated to
    start at the smallest name). Every edge that lies on some cycle appears in the result."""
    cycles = set()
    for comp in strongly_connected_components(graph):
        members = set(comp)
        if len(comp) == 1 and comp[0] not in graph.get(comp[0], ()):
            continue
        for u in comp:
            for v in sorted(graph.get(u, ())):
                if v in members:
                    ring = [u, *_shortest_path(graph, v, u, members)[:-1]] if v != u else [u]
                    i = ring.index(min(ring))
                    cycles.add(tuple(ring[i:] + ring[:i]))
    return [[*c, c[0]] for c in sorted(cycles, key=lambda c: (len(c), c))]


def _format_cycle(cycle: list[str], where: dict) -> str:
    steps = "\n".join(f"      {a} -> {b}  ({where.get((a, b), '?')})" for a, b in zip(cycle, cycle[1:]))
    return "  " + " -> ".join(cycle) + "\n" + steps


def test_cycle_finder_on_a_synthetic_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(), "x": {"y"}, "y": {"x"},
             "s": {"s"}}
    comps = {tuple(c) for c in strongly_connected_components(graph)}
    assert ("a", "b", "c") in comps and ("x", "y") in comps and ("d",) in comps
    assert find_cycles(graph) == [["s", "s"], ["x", "y", "x"], ["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    # two cycles sharing a node: both are reported
    assert find_cycles({"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}) == [["a", "b", "a"], ["a", "c", "a"]]
    # a ring deeper than the recursion limit: the SCC search is iterative
    ring = {i: {(i + 1) % 5000} for i in range(5000)}
    assert [len(c) for c in strongly_connected_components(ring)] == [5000]


def test_import_graph_rules_on_a_synthetic_tree(tmp_path):
    files = {
        "pkg/__init__.py": "from pkg.core import thing\n",
        "pkg/core.py": "from pkg import helpers\nthing = 1\n",
        "pkg/helpers.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.core import thing\n"
                           "def f():\n    from .sub import leaf\n"),
        "pkg/sub/__init__.py": "",
        "pkg/sub/leaf.py": "import importlib\ndef g():\n    return importlib.import_module('pkg.core')\n",
        "other/__init__.py": "",
        "other/mod.py": "import os\nimport pkg.sub.leaf\nfrom pkg import thing\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph, where = import_graph(tmp_path, ("pkg", "other"))
    assert graph["pkg"] == {"pkg.core"}
    assert graph["pkg.core"] == {"pkg.helpers"}  # submodule, and pkg/__init__ (its own parent) not implied
    assert graph["pkg.helpers"] == {"pkg.core", "pkg.sub", "pkg.sub.leaf"}  # TYPE_CHECKING and deferred relative kept
    assert graph["pkg.sub.leaf"] == {"pkg.core"}
    assert graph["other.mod"] == {"pkg", "pkg.sub", "pkg.sub.leaf"}  # parents of an import are edges
    assert where[("pkg.helpers", "pkg.sub.leaf")] == "pkg/helpers.py:5"
    assert find_cycles(graph) == [["pkg.core", "pkg.helpers", "pkg.core"],
                                  ["pkg.core", "pkg.helpers", "pkg.sub.leaf", "pkg.core"]]


def test_no_import_cycles_among_first_party_packages():
    graph, where = import_graph(ROOT)
    assert len(graph) > 50, "the module scan found too few modules"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (module -> module it imports):\n" + "\n".join(
        _format_cycle(c, where) for c in cycles)


# --------------------------------------------------------------------------- function length


def function_lengths(root: Path, package: str = "libra") -> dict[str, int]:
    """``"path:qualname" -> lines`` (``def`` line to ``end_lineno``, decorators excluded) of every
    function, method and nested function under ``package``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = _parse(path)
        stack = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        out[f"{rel}:{name}"] = child.end_lineno - child.lineno + 1
                    stack.append((child, name + "."))
                else:
                    stack.append((child, prefix))
    return out


def test_function_length_scan_counts_def_to_end():
    lengths = function_lengths(ROOT)
    assert 0 < lengths["libra/runtime/program.py:compile_worker"] <= MAX_FUNCTION_LINES
    assert lengths["libra/runtime/attention.py:LibraAttention.forward"] > 10


def test_no_long_functions():
    lengths = {k: n for pkg in PACKAGES for k, n in function_lengths(ROOT, pkg).items()}
    long = {k: n for k, n in lengths.items() if n > MAX_FUNCTION_LINES}
    offenders = sorted(k for k in long if k not in LONG_FUNCTION_ALLOW)
    stale = sorted(k for k in LONG_FUNCTION_ALLOW if k not in long)
    msgs = []
    if offenders:
        msgs.append(f"functions over {MAX_FUNCTION_LINES} lines (split them):\n"
                    + "\n".join(f"  {k} ({long[k]} lines)" for k in offenders))
    if stale:
        msgs.append("stale LONG_FUNCTION_ALLOW entries (gone or now short; remove them):\n" + "\n".join(
            f"  {k} ({lengths[k]} lines)" if k in lengths else f"  {k} (not found)" for k in stale))
    assert not msgs, "\n".join(msgs)


# --------------------------------------------------------------------------- core and extensions


def test_core_never_imports_an_extension():
    graph, where = import_graph(ROOT)
    core = [m for m in graph if m.startswith("libra") and not (m == EXTENSIONS or m.startswith(EXTENSIONS + "."))]
    bad = sorted((m, t) for m in core for t in graph[m] if t == EXTENSIONS or t.startswith(EXTENSIONS + "."))
    assert not bad, "core modules import an extension (use a seam: chunking registry, hops, PlacementPolicy):\n" + \
        "\n".join(f"  {m} -> {t}  ({where[(m, t)]})" for m, t in bad)


# --------------------------------------------------------------------------- parameters


def _decorated_by(node, words) -> bool:
    return any(w in ast.unparse(d) for d in node.decorator_list for w in words)


def parameter_counts(root: Path, packages=PACKAGES) -> dict[str, tuple[int, bool]]:
    """``"path:qualname" -> (parameters, is_compiled_kernel)`` of every function under ``packages``
    (``self``/``cls`` not counted; click entry points left out). A compiled kernel is any function
    of ``libra/jit/``."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            stack = [(_parse(path), "")]
            while stack:
                node, prefix = stack.pop()
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        a = child.args
                        names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                        n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
                        n -= bool(names) and names[0] in ("self", "cls")
                        if not _decorated_by(child, ("click.", "option", "command")):
                            out[f"{rel}:{prefix}{child.name}"] = (n, rel.startswith("libra/jit/"))
                        stack.append((child, f"{prefix}{child.name}."))
                    elif isinstance(child, ast.ClassDef):
                        stack.append((child, f"{prefix}{child.name}."))
                    else:
                        stack.append((child, prefix))
    return out


def test_no_function_takes_too_many_parameters():
    counts = parameter_counts(ROOT)
    limit = {k: MAX_KERNEL_PARAMETERS if kernel else MAX_PARAMETERS for k, (_, kernel) in counts.items()}
    over = {k: n for k, (n, _) in counts.items() if n > limit[k]}
    offenders = sorted(k for k in over if k not in MANY_PARAMETERS_ALLOW)
    stale = sorted(k for k in MANY_PARAMETERS_ALLOW if k not in over)
    assert not offenders, "functions over the parameter limit (take a config or a policy object):\n" + \
        "\n".join(f"  {k} ({over[k]} parameters)" for k in offenders)
    assert not stale, f"stale MANY_PARAMETERS_ALLOW entries (remove them): {stale}"


# --------------------------------------------------------------------------- issue numbers


def test_no_issue_numbers_in_production_code():
    import re  # noqa: PLC0415

    pattern = re.compile(r"\bissues? ?#?\d+", re.IGNORECASE)
    hits = [f"{p.relative_to(ROOT)}:{i}" for pkg in ("libra", "baselines") for p in sorted((ROOT / pkg).rglob("*.py"))
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not hits, "production code names an issue number (say what the code does instead):\n  " + "\n  ".join(hits)
