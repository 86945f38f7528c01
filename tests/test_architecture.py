"""The package's shape, checked from the source with ``ast`` (nothing is imported, torch included).

- Import direction: every module under ``tessera/`` belongs to a layer (``LAYERS``, lowest first) and
  imports only from its own layer or lower ones. Every tessera import counts: top-level and
  function-local, ``import x``, ``from x import y``, relative imports, ``if TYPE_CHECKING:`` blocks and
  ``importlib.import_module("tessera...")`` with a literal name. ``core`` (the run description,
  launch, precision) sits between ``config`` and the packages that take the run description, with no
  upward name: the optimizer's documented path is ``tessera.optim`` itself.
- No import cycle among tessera's packages (``tessera.<name>``, leaf modules included), and none among
  its modules, not even between two files of one folder (every import counts, as for the layers).
- No function in the package longer than ``MAX_FUNCTION_LINES``; no length cap on files (a file is split
  where it holds two jobs, not at a line count).
- One reader of the run's precision: outside ``config/`` and ``core/``, nothing calls the model-precision
  parsers (``resolve_model_dtype``, ``parse_dtype``) or reads ``model.dtype`` from a config.
- One name per precision concept: one module named ``precision.py`` in the package, and no two classes
  there about precision or dtypes whose names differ only by a prefix (``Precision`` beside ``RunPrecision``).
- No ``sys.path`` edits in ``tools/``, ``tests/``, ``benchmarks/``, ``harness/`` or ``train.py``: the
  package is installed (``pip install -e .``), pytest puts the repository root on ``sys.path``
  (pytest.ini), and ``python -m benchmarks`` runs from the root.
- The installed package imports none of the repository's uninstalled folders (``harness``,
  ``benchmarks``, ``tests``, ``tools``, ``train``): test and measurement helpers live outside it.
- No module docstring narrating measurements (a measured figure belongs in BENCHMARKS.md or docs/).
- One builder of the training stack (``BUILDER``): outside it, no function or module body constructs
  the trainer or the optimizer from a config (calls ``Trainer``/``build_optimizer``), nor puts a decoder
  (``build_model``) and a ``HybridZeroOptimizer`` together. Found by walking every call in tessera/,
  train.py, tools/, benchmarks/ and tests/ per enclosing function; a call of a name means any call
  whose function is that name or an attribute of that name (``x.Trainer(...)``).

The checkers take the repository root, so the tests below also run them on small trees in tmp_path
with a deliberate violation (a checker that never fails proves nothing).
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# lowest first: a module may import its own layer and the layers before it, never a later one
LAYERS = ("leaf", "parallel", "model", "config", "precision", "core", "memory", "data", "optim", "train", "analysis", "checkpoint", "plan")
# tessera/<name>.py modules that import no tessera package (stdlib / torch only); "__init__" is tessera/__init__.py
LEAF_MODULES = frozenset({"__init__", "files", "cli_args", "logs", "error_file", "run", "hardware"})
MAX_FUNCTION_LINES = 80
PRECISION_READERS = ("tessera/config/", "tessera/precision/", "tessera/core/")  # the only places that resolve the run's precision
PRECISION_PARSERS = frozenset({"resolve_model_dtype", "parse_dtype"})
PRECISION_WORDS = ("precision", "dtype")  # a class whose name holds one of these names a precision concept
SCRIPT_PLACES = ("tools", "tests", "benchmarks", "harness", "train.py")
# top-level names of the repository that are not installed: the package must not import them
UNINSTALLED = ("harness", "benchmarks", "tests", "tools", "train")
BUILDER = "tessera/train/builder.py"  # the one place the training stack is assembled
STACK_ONLY_IN_BUILDER = frozenset({"Trainer", "build_optimizer"})  # constructed from a config there only
DECODER, OPTIMIZER = "build_model", "HybridZeroOptimizer"  # together in one function = a second builder


# ------------------------------------------------------------------------------------------ helpers
def _py_files(base: Path) -> list[Path]:
    if base.is_file():
        return [base] if base.suffix == ".py" else []
    return sorted(p for p in base.rglob("*.py") if "__pycache__" not in p.parts)


def _parse(path: Path, root: Path, problems: list[str]) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as e:
        problems.append(f"{path.relative_to(root)}:{e.lineno}: does not parse ({e.msg})")
        return None


def module_name(path: Path, root: Path) -> str:
    """``tessera/model/attention.py`` -> ``tessera.model.attention``; a package's ``__init__`` -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _exists(root: Path, dotted: str) -> bool:
    """Whether ``dotted`` names a module or package in the tree under ``root``."""
    base = root.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def tessera_imports(path: Path, root: Path, problems: list[str]) -> list[tuple[int, str]]:
    """(line, imported module) for every tessera import in ``path``, wherever it sits in the file."""
    tree = _parse(path, root, problems)
    if tree is None:
        return []
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)]) if node.level - 1 < len(parts) else ""
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:  # ``from pkg import submodule`` imports the submodule
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if alias.name != "*" and _exists(root, sub) else base))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                   or isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))):
            found.append((node.lineno, node.args[0].value))
    return [(line, name) for line, name in found if name == "tessera" or name.startswith("tessera.")]


def uninstalled_imports(root: Path) -> list[str]:
    """``file:line -> module`` for every import under root/tessera of a folder that is not installed."""
    out: list[str] = []
    for path in _py_files(root / "tessera"):
        tree = _parse(path, root, out)
        if tree is None:
            continue
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            out += [f"{path.relative_to(root)}:{node.lineno} -> {n}" for n in names if n.split(".")[0] in UNINSTALLED]
    return sorted(out)


def layer_of(dotted: str) -> str | None:
    """The layer of module ``tessera.<name>...``; None when ``<name>`` is in no layer."""
    name = dotted.split(".")[1] if "." in dotted else "__init__"  # plain ``tessera`` is tessera/__init__.py
    if name in LEAF_MODULES:
        return "leaf"
    return name if name in LAYERS else None


def package_of(dotted: str) -> str:
    """``tessera.model.attention`` -> ``model``; ``tessera`` -> ``__init__``."""
    return dotted.split(".")[1] if "." in dotted else "__init__"


def import_graph(root: Path) -> tuple[list[tuple[str, int, str, str]], list[str]]:
    """(file, line, importer module, imported module) for every tessera import under root/tessera, and
    the files that do not parse."""
    problems: list[str] = []
    edges = []
    for path in _py_files(root / "tessera"):
        me = module_name(path, root)
        for line, target in tessera_imports(path, root, problems):
            edges.append((str(path.relative_to(root)), line, me, target))
    return edges, problems


def layering_violations(root: Path) -> list[str]:
    """``file:line -> target (why)`` for every import that goes up a layer or touches an unlayered module."""
    edges, problems = import_graph(root)
    out = list(problems)
    for path in _py_files(root / "tessera"):
        if layer_of(module_name(path, root)) is None:
            out.append(f"{path.relative_to(root)}: module {module_name(path, root)} is in no layer "
                       f"(add its package to LAYERS in tests/test_architecture.py)")
    for file, line, me, target in edges:
        mine, theirs = layer_of(me), layer_of(target)
        if mine is None:
            continue  # reported above
        if theirs is None:
            out.append(f"{file}:{line} -> {target} (not a module in any layer)")
        elif LAYERS.index(theirs) > LAYERS.index(mine):
            out.append(f"{file}:{line} -> {target} ({mine} imports {theirs}, a higher layer)")
    return sorted(set(out))


def package_cycles(root: Path) -> list[str]:
    """Each strongly connected set of 2+ tessera packages, with the imports that close it (Tarjan)."""
    edges, _ = import_graph(root)
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for file, line, me, target in edges:
        a, b = package_of(me), package_of(target)
        if a != b and b != "__init__":  # ``import tessera`` runs only the (leaf) package __init__
            graph.setdefault(a, set()).add(b)
            graph.setdefault(b, set())
            where.setdefault((a, b), f"{file}:{line} -> {target}")
    sccs = _tarjan(graph)
    return [" <-> ".join(scc) + ": " + "; ".join(where[(a, b)] for a in scc for b in scc if (a, b) in where)
            for scc in sccs]


def sys_path_edits(root: Path, places=SCRIPT_PLACES) -> list[str]:
    """``file:line`` of every ``sys.path`` insert/append/extend/assignment in the given places."""
    out: list[str] = []
    for place in places:
        for path in _py_files(root / place):
            tree = _parse(path, root, out)
            if tree is None:
                continue
            for node in ast.walk(tree):
                hit = None
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("insert", "append", "extend") and _is_sys_path(node.func.value)):
                    hit = f"sys.path.{node.func.attr}"
                elif isinstance(node, (ast.Assign, ast.AugAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        if _is_sys_path(t) or isinstance(t, ast.Subscript) and _is_sys_path(t.value):
                            hit = "sys.path assignment"
                if hit:
                    out.append(f"{path.relative_to(root)}:{node.lineno}: {hit}")
    return sorted(out)


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def _tarjan(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of 2+ nodes of ``graph`` (every node a key)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    sccs: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


def module_cycles(root: Path) -> list[str]:
    """Each strongly connected set of 2+ tessera modules (a package is its ``__init__``), with the imports
    that close it. An import of ``a.b.c`` counts as an edge to ``a.b.c`` only: the parent packages it
    initialises first are not edges (else every package that re-exports its modules would be a cycle)."""
    edges, _ = import_graph(root)
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for file, line, me, target in edges:
        if me != target:
            graph.setdefault(me, set()).add(target)
            graph.setdefault(target, set())
            where.setdefault((me, target), f"{file}:{line} -> {target}")
    return [" <-> ".join(scc) + ": " + "; ".join(where[(a, b)] for a in scc for b in scc if (a, b) in where)
            for scc in _tarjan(graph)]


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``file:line name(): N lines`` for every function or method of the package longer than ``limit``."""
    out: list[str] = []
    for path in _py_files(root / "tessera"):
        tree = _parse(path, root, out)
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name}(): {n} lines (limit {limit})")
    return sorted(out)


def _reads_model_dtype(node: ast.AST) -> bool:
    """``<x>.model.dtype``, ``model_cfg["dtype"]`` / ``model_cfg.get("dtype")`` on a name containing "model"."""
    if isinstance(node, ast.Attribute) and node.attr == "dtype":
        v = node.value
        return isinstance(v, ast.Attribute) and v.attr == "model" or isinstance(v, ast.Name) and v.id == "model_cfg"
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "dtype":
        return _names_a_model_section(node.value)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "dtype"):
        return _names_a_model_section(node.func.value)
    return False


def _names_a_model_section(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return "model" in node.id
    if isinstance(node, ast.Attribute):
        return node.attr == "model"
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "model"


def precision_rederivations(root: Path, places=("tessera", "train.py", "tools")) -> list[str]:
    """``file:line: what`` wherever code outside ``PRECISION_READERS`` resolves the run's precision itself."""
    out: list[str] = []
    for place in places:
        for path in _py_files(root / place):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(PRECISION_READERS):
                continue
            tree = _parse(path, root, out)
            for node in ast.walk(tree) if tree is not None else ():
                if isinstance(node, ast.ImportFrom) and any(a.name in PRECISION_PARSERS for a in node.names):
                    out.append(f"{rel}:{node.lineno}: imports a precision parser (take the run's Precision)")
                elif _reads_model_dtype(node):
                    out.append(f"{rel}:{node.lineno}: reads model.dtype from a config (take the run's Precision)")
    return sorted(set(out))


def precision_name_collisions(root: Path) -> list[str]:
    """Two homes or two names of one precision concept: every ``precision.py`` past the first, and each pair of
    precision/dtype classes under root/tessera where one name is the other's with a prefix."""
    out: list[str] = []
    homes = [p.relative_to(root).as_posix() for p in _py_files(root / "tessera") if p.name == "precision.py"]
    if len(homes) > 1:
        out.append(f"{len(homes)} modules named precision.py: {', '.join(homes)}")
    classes: dict[str, str] = {}
    for path in _py_files(root / "tessera"):
        tree = _parse(path, root, out)
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.ClassDef) and any(w in node.name.lower() for w in PRECISION_WORDS):
                classes.setdefault(node.name, f"{path.relative_to(root).as_posix()}:{node.lineno}")
    for long_name, at in sorted(classes.items()):
        out += [f"{at}: class {long_name} is {short} ({classes[short]}) with a prefix"
                for short in sorted(classes) if short != long_name and long_name.endswith(short)]
    return out


# a figure with a unit ("~1-2 ms", "5-60x", "60 GFLOP/s", "12%") ...
_FIGURE = r"\d[\d.,]*(?:\s*-\s*\d[\d.,]*)?\s*(?:x|ms|us|µs|ns|s|%|[GMT]?FLOP/s|[GMK]i?B/s|tok/s|tokens/s)(?![\w/])"
# ... that is approximate ("~") or said to be measured on the same line
_NARRATED = re.compile(rf"~\s*{_FIGURE}|\bmeasured\b.*{_FIGURE}|{_FIGURE}.*\bmeasured\b", re.I)


def narrated_measurements(root: Path) -> list[str]:
    """Module docstring lines that report measured figures (they belong in BENCHMARKS.md or docs/).

    A heuristic: a line with an approximate figure with a unit (``~30 us``) or with the word "measured"
    and a figure with a unit. Design constants ("checks every 50 ms") and formulas ("3 x forward") pass.
    """
    out: list[str] = []
    for path in _py_files(root / "tessera"):
        tree = _parse(path, root, out)
        doc = ast.get_docstring(tree, clean=False) if tree is not None else None
        if not doc:
            continue
        first = tree.body[0].lineno
        for i, line in enumerate(doc.splitlines()):
            if _NARRATED.search(line):
                out.append(f"{path.relative_to(root)}:{first + i}: {line.strip()}")
    return out


def _fmt(items: list[str]) -> str:
    return "\n  " + "\n  ".join(items)


def _called_names(body: list[ast.stmt]) -> list[tuple[int, str]]:
    """(line, name) of every call in ``body``, not descending into nested functions or classes."""
    out: list[tuple[int, str]] = []
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name:
                out.append((node.lineno, name))
        stack.extend(ast.iter_child_nodes(node))
    return out


def stack_assemblies(root: Path, places=("tessera", *SCRIPT_PLACES)) -> list[str]:
    """Places outside ``BUILDER`` that assemble the training stack themselves (see the module docstring)."""
    out: list[str] = []
    for place in places:
        for path in _py_files(root / place):
            rel = path.relative_to(root).as_posix()
            if rel == BUILDER:
                continue
            tree = _parse(path, root, out)
            if tree is None:
                continue
            scopes: list[tuple[str, list[ast.stmt]]] = [("<module>", tree.body)]
            scopes += [(n.name, n.body) for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            scopes += [("<lambda>", [ast.Expr(n.body)]) for n in ast.walk(tree) if isinstance(n, ast.Lambda)]
            for scope, body in scopes:
                calls = _called_names(body)
                names = {name for _, name in calls}
                for line, name in calls:
                    if name in STACK_ONLY_IN_BUILDER:
                        out.append(f"{rel}:{line}: {scope}() calls {name} (build the stack with {BUILDER})")
                if DECODER in names and OPTIMIZER in names:
                    line = min(ln for ln, name in calls if name == OPTIMIZER)
                    out.append(f"{rel}:{line}: {scope}() builds a decoder and a {OPTIMIZER} itself "
                               f"(build the stack with {BUILDER})")
    return sorted(set(out))


# ------------------------------------------------------------------------------------------ the repository
def test_imports_go_one_way():
    bad = layering_violations(ROOT)
    assert not bad, f"imports against the layer order {' < '.join(LAYERS)}:{_fmt(bad)}"


def test_no_import_cycle_among_packages():
    cycles = package_cycles(ROOT)
    assert not cycles, f"import cycles among tessera's packages:{_fmt(cycles)}"


def test_no_sys_path_edits_in_tools_tests_benchmarks():
    edits = sys_path_edits(ROOT)
    assert not edits, f"sys.path edits (install the package; pytest.ini sets pythonpath):{_fmt(edits)}"


def test_the_package_imports_nothing_uninstalled():
    found = uninstalled_imports(ROOT)
    assert not found, f"the installed package imports folders setup.py does not install:{_fmt(found)}"


def test_no_import_cycle_among_modules():
    cycles = module_cycles(ROOT)
    assert not cycles, f"import cycles among tessera's modules:{_fmt(cycles)}"


def test_package_functions_are_short():
    found = long_functions(ROOT)
    assert not found, f"functions above {MAX_FUNCTION_LINES} lines:{_fmt(found)}"


def test_only_config_and_core_resolve_the_run_precision():
    found = precision_rederivations(ROOT)
    assert not found, f"the run's precision re-derived outside {' and '.join(PRECISION_READERS)}:{_fmt(found)}"


def test_one_name_per_precision_concept():
    found = precision_name_collisions(ROOT)
    assert not found, f"a precision concept with two homes or two names:{_fmt(found)}"


def test_the_training_stack_is_assembled_in_one_function():
    found = stack_assemblies(ROOT)
    assert not found, f"the training stack assembled outside {BUILDER}:{_fmt(found)}"
    assert (ROOT / BUILDER).is_file()


def test_module_docstrings_narrate_no_measurements():
    found = narrated_measurements(ROOT)
    assert not found, f"measurements narrated in module docstrings (move them to BENCHMARKS.md/docs):{_fmt(found)}"


def test_every_layer_and_leaf_exists():
    """The table names real code: a renamed package must be renamed here too, not silently unchecked."""
    for name in LAYERS:
        if name != "leaf":
            assert (ROOT / "tessera" / name / "__init__.py").is_file(), name
    assert not (ROOT / "tessera" / "dist").exists()  # a folder name Python tooling reads as build output
    present = [m for m in LEAF_MODULES if m != "__init__" and (ROOT / "tessera" / f"{m}.py").is_file()]
    assert {"cli_args", "files"} <= set(present)


# ------------------------------------------------------------------------------------------ the checkers fail
def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def _tiny_tree(root: Path, **extra: str) -> Path:
    files = {f"tessera/{name}/__init__.py": "" for name in LAYERS if name != "leaf"}
    files.update({
        "tessera/__init__.py": '__version__ = "0"\n',
        "tessera/cli_args.py": "import argparse\n",
        "tessera/core/job.py": "from tessera.config import schema\n",
        "tessera/config/schema.py": "from tessera.model import attention\n",
        "tessera/parallel/comm.py": "import torch\n",
        "tessera/model/attention.py": "from tessera.parallel.comm import x\nfrom ..parallel import comm\n",
        "tessera/train/opt.py": "from tessera.model import attention\nfrom . import step\n",
        "tessera/train/step.py": "def f():\n    from tessera import __version__\n",
    })
    files.update({k.replace("__", "/") + ".py": v for k, v in extra.items()})  # tessera__model__x: tessera/model/x.py
    return _write(root, files)


def test_a_clean_tree_passes(tmp_path):
    root = _tiny_tree(tmp_path)
    assert layering_violations(root) == []
    assert package_cycles(root) == []
    assert module_cycles(root) == []


def test_a_module_cycle_inside_one_folder_is_reported(tmp_path):
    root = _tiny_tree(tmp_path, tessera__train__step="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                     "    from tessera.train.opt import Opt\n")
    assert package_cycles(root) == []  # one package: only the module graph sees it
    assert module_cycles(root) == ["tessera.train.opt <-> tessera.train.step: tessera/train/opt.py:2 -> "
                                   "tessera.train.step; tessera/train/step.py:3 -> tessera.train.opt"]


@pytest.mark.parametrize("text, target", [
    ("import tessera.train\n", "tessera.train"),
    ("def f():\n    from tessera.train.opt import y\n", "tessera.train.opt"),  # function-local
    ("from ..train import opt\n", "tessera.train.opt"),  # relative
    ("from tessera import train\n", "tessera.train"),  # a package imported by name
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tessera.core.job import Job\n", "tessera.core.job"),
    ("import importlib\nm = importlib.import_module('tessera.checkpoint')\n", "tessera.checkpoint"),
    ("from tessera.config.schema import X\n", "tessera.config.schema"),
])
def test_an_upward_import_is_reported_with_file_and_line(tmp_path, text, target):
    root = _tiny_tree(tmp_path, tessera__model__bad=text)
    line = text.count("\n")
    assert layering_violations(root) == [f"tessera/model/bad.py:{line} -> {target} "
                                         f"(model imports {layer_of(target)}, a higher layer)"]


def test_a_leaf_module_importing_a_package_is_reported(tmp_path):
    root = _tiny_tree(tmp_path, tessera__cli_args="from tessera.parallel import comm\n")
    assert layering_violations(root) == ["tessera/cli_args.py:1 -> tessera.parallel.comm (leaf imports parallel, "
                                         "a higher layer)"]


def test_an_unlayered_module_and_a_syntax_error_are_reported(tmp_path):
    root = _tiny_tree(tmp_path)
    _write(root, {"tessera/newpkg/__init__.py": "", "tessera/model/broken.py": "from x import a as b as c\n"})
    bad = layering_violations(root)
    assert any(b.startswith("tessera/newpkg/__init__.py: module tessera.newpkg is in no layer") for b in bad), bad
    assert any(b.startswith("tessera/model/broken.py:1: does not parse") for b in bad), bad


def test_a_package_cycle_is_reported(tmp_path):
    root = _tiny_tree(tmp_path, tessera__parallel__bad="def f():\n    import tessera.model.attention\n")
    assert package_cycles(root) == ["model <-> parallel: tessera/model/attention.py:1 -> tessera.parallel.comm; "
                                    "tessera/parallel/bad.py:2 -> tessera.model.attention"]


def test_an_upward_import_added_to_a_copy_of_the_real_package_is_caught(tmp_path):
    """``import tessera.train`` appended to a copy of tessera/parallel/comm.py: exactly that one new finding."""
    shutil.copytree(ROOT / "tessera", tmp_path / "tessera", ignore=shutil.ignore_patterns("__pycache__"))
    comm = tmp_path / "tessera" / "parallel" / "comm.py"
    text = comm.read_text()
    comm.write_text(text + ("" if text.endswith("\n") else "\n") + "import tessera.train\n")
    line = len(comm.read_text().splitlines())
    new = set(layering_violations(tmp_path)) - set(layering_violations(ROOT))
    assert new == {f"tessera/parallel/comm.py:{line} -> tessera.train (parallel imports train, a higher layer)"}


def test_an_uninstalled_import_is_found(tmp_path):
    _write(tmp_path, {
        "tessera/train/a.py": "import harness.distributed\n\ndef f():\n    from benchmarks.dp import x\n",
        "tessera/train/ok.py": "from . import a\nimport torch\nfrom tessera.files import y\n",
    })
    assert uninstalled_imports(tmp_path) == ["tessera/train/a.py:1 -> harness.distributed",
                                             "tessera/train/a.py:4 -> benchmarks.dp"]


def test_sys_path_edits_are_found(tmp_path):
    _write(tmp_path, {
        "tools/a.py": "import sys, os\nsys.path.insert(0, os.getcwd())\n",
        "tests/b.py": "import sys\n\ndef f():\n    sys.path.append('x')\n    sys.path[:0] = ['y']\n",
        "tests/ok.py": "import sys\nprint(sys.path, 'sys.path.insert(0, x)')\n",
    })
    assert sys_path_edits(tmp_path) == ["tests/b.py:4: sys.path.append", "tests/b.py:5: sys.path assignment",
                                        "tools/a.py:2: sys.path.insert"]


def test_long_functions_and_narrated_measurements_are_found(tmp_path):
    body = "    x = 1\n"
    _write(tmp_path, {
        "tessera/parallel/big.py": "def big():\n" + body * MAX_FUNCTION_LINES + "\n\ndef ok():\n" + body * 3,
        "tessera/parallel/ok.py": '"""Checks every 50 ms; training = 3 x forward."""\n\nclass A:\n    def m(self):\n'
                                  + "    " + body * (MAX_FUNCTION_LINES - 1),
        "tessera/model/slow.py": '"""Attention.\n\nThis costs ~1-2 ms per call.\nWe measured 5-60x slower bf16.\n"""\n',
    })
    assert long_functions(tmp_path) == [f"tessera/parallel/big.py:1 big(): {MAX_FUNCTION_LINES + 1} lines "
                                        f"(limit {MAX_FUNCTION_LINES})"]
    assert narrated_measurements(tmp_path) == ["tessera/model/slow.py:3: This costs ~1-2 ms per call.",
                                               "tessera/model/slow.py:4: We measured 5-60x slower bf16."]


def test_a_second_stack_builder_is_found(tmp_path):
    root = _write(tmp_path, {
        BUILDER: "def build_training_stack(cfg):\n    return Trainer(build_optimizer(cfg))\n",
        "benchmarks/mine.py": "def _stack(cfg):\n    m = build_model(cfg)\n    return m, HybridZeroOptimizer(m)\n",
        "tests/test_x.py": "import tessera.train.step as s\nfor _ in range(2):\n    t = s.Trainer(1)\n",
        "tools/ok.py": "def f(cfg):\n    return build_training_stack(cfg), build_model(cfg)\n",
        "train.py": "go = lambda cfg: build_optimizer(cfg)\n",
    })
    found = stack_assemblies(root)
    assert [f.split(":")[0] for f in found] == ["benchmarks/mine.py", "tests/test_x.py", "train.py"], found
    assert "builds a decoder and a HybridZeroOptimizer" in found[0] and "calls Trainer" in found[1]


def test_a_precision_re_derivation_is_found(tmp_path):
    root = _write(tmp_path, {
        "tessera/train/a.py": "from tessera.config.dtypes import resolve_model_dtype\n\ndef f(cfg):\n"
                              "    return cfg.model.dtype\n",
        "tessera/plan/b.py": "def g(model_cfg, cfg):\n    return model_cfg.get('dtype'), cfg['model']['dtype']\n",
        "tools/c.py": "def h(run, t):\n    return run.precision.dtype, t.dtype, {'dtype': 1}['dtype']\n",
        "tessera/core/ok.py": "from tessera.config.dtypes import resolve_model_dtype\nx = cfg.model.dtype\n",
    })
    assert precision_rederivations(root) == [
        "tessera/plan/b.py:2: reads model.dtype from a config (take the run's Precision)",
        "tessera/train/a.py:1: imports a precision parser (take the run's Precision)",
        "tessera/train/a.py:4: reads model.dtype from a config (take the run's Precision)",
    ]


def test_two_precision_homes_and_prefixed_names_are_found(tmp_path):
    root = _write(tmp_path, {
        "tessera/config/precision.py": "class Precision:\n    pass\n",
        "tessera/core/precision.py": "class RunPrecision:\n    pass\n\n\nclass ModelDtype:\n    pass\n",
        "tessera/train/report.py": "class PrecisionReport:\n    pass\n\n\nclass Mixer:\n    pass\n",
    })
    assert precision_name_collisions(root) == [
        "2 modules named precision.py: tessera/config/precision.py, tessera/core/precision.py",
        "tessera/core/precision.py:1: class RunPrecision is Precision (tessera/config/precision.py:1) with a prefix",
    ]


# contract paths of ../shared/DESIGN.md kept only for InternEvo's imports: the code lives elsewhere
CONTRACT_REEXPORTS = frozenset({"tessera/core/grad_scaler.py"})  # the loss scalers: tessera/precision/scaler.py


def test_every_core_module_defines_something():
    """``tessera/core`` holds real code: each of its modules defines a function or a class of its own, except a
    contract path the design keeps importable for InternEvo code (``CONTRACT_REEXPORTS``)."""
    for path in _py_files(ROOT / "tessera" / "core"):
        if path.name == "__init__.py" or path.relative_to(ROOT).as_posix() in CONTRACT_REEXPORTS:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert defined, f"{path.relative_to(ROOT)} defines nothing (a re-export belongs where the code lives)"
