"""The package's import graph: no loops, integrations and tools depend on the core, never the reverse, and
code outside the package imports private modules only through cosdistill.testing.

Every import of a cosdistill module counts, at module level or inside a function, except those under
``if TYPE_CHECKING:`` (annotations only).
"""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "cosdistill"
# Modules built on the core: no core module may import them.
OUTER = {"hf", "trl", "distributed", "distributed.data_parallel", "distributed.vocab_parallel", "tools", "tools.bench",
         "tools.cli", "tools.demo", "tools.check", "testing", "__main__", "__init__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def imported(path: Path, name: str) -> set[str]:
    """The cosdistill modules that the module at path imports."""
    package = list(path.relative_to(PACKAGE).parent.parts)  # the folder the module is in, under cosdistill
    found = set()

    def visit(node):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("cosdistill"):
                target = node.module.removeprefix("cosdistill").lstrip(".")
            else:
                target = None
            if target is not None:
                for alias in node.names:  # `from . import fp8` names a module; `from .api import x` does not
                    submodule = f"{target}.{alias.name}" if target else alias.name
                    found.add(submodule if (PACKAGE / f"{submodule.replace('.', '/')}.py").exists() else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {module for module in found if module and module != name}


def graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: imported(path, name) & set(modules) for name, path in modules.items()}


def test_the_graph_sees_known_edges():
    edges = graph()
    assert {"_plan", "_compile", "_device"} <= edges["api"] and "_chunk_loop" in edges["_plan"]
    assert "_plan" in edges["_compile"] and "kernels.row_step_triton" in edges["_backends"]


def test_no_import_loops():
    edges, done, stack = graph(), set(), []

    def walk(module):
        if module in stack:
            raise AssertionError("import loop: " + " -> ".join(stack[stack.index(module):] + [module]))
        if module in done:
            return
        stack.append(module)
        for target in sorted(edges[module]):
            walk(target)
        stack.pop()
        done.add(module)

    for module in sorted(edges):
        walk(module)


def test_the_core_imports_no_integration_or_tool():
    edges = graph()
    for module, targets in edges.items():
        if module not in OUTER:
            assert not targets & OUTER, f"{module} imports {sorted(targets & OUTER)}"


def test_only_the_backends_pick_kernels():
    """The kernels are chosen once, by _backends.py: no other core module imports one (so impl="torch" runs
    torch alone); the kernels import only the torch specs they mirror."""
    edges = graph()
    for module, targets in edges.items():
        if module not in OUTER and module != "_backends" and not module.startswith("kernels"):
            assert not {t for t in targets if t.startswith("kernels")}, f"{module} imports {sorted(targets)}"
        if module.startswith("kernels."):
            assert all(t.startswith("kernels") or t in ("_row_step", "_row_step_jsd", "_fingerprint", "_teacher_fp8")
                       for t in targets), \
                f"{module} imports {sorted(targets)}"



REPO = Path(__file__).resolve().parents[1]
# The benchmarks and their tests are being moved onto the public modules: checked on their own until then.
BENCHMARK_FILES = sorted((REPO / "benchmarks").rglob("*.py")) + [REPO / "tests" / "test_benchmarks.py"]


def is_private(name: str) -> bool:
    """Whether a dotted name reaches into the package's internals: a part after cosdistill that starts with _,
    or the kernels package."""
    parts = name.split(".")
    return parts[0] == "cosdistill" and (any(part.startswith("_") for part in parts[1:]) or parts[1:2] == ["kernels"])


def private_imports(source: str) -> list[str]:
    """Each import in this source of a private cosdistill module or name, as 'line: name'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [f"{node.lineno}: {name}" for name in names if is_private(name)]
    return found


def assert_public_imports_only(paths):
    offenders = {str(path.relative_to(REPO)): found for path in paths if (found := private_imports(path.read_text()))}
    assert not offenders, f"import the internals through cosdistill.testing: {offenders}"


def test_private_imports_are_seen():
    source = ("import cosdistill._plan\nfrom cosdistill import _plan, api\nfrom cosdistill.kernels import labels\n"
              "def f():\n    from cosdistill._compile import op\n"
              "from cosdistill.testing import kernels, plan\nfrom cosdistill.tools import check\nimport cosdistill\n")
    assert private_imports(source) == ["1: cosdistill._plan", "2: cosdistill._plan", "3: cosdistill.kernels",
                                       "3: cosdistill.kernels.labels", "5: cosdistill._compile",
                                       "5: cosdistill._compile.op"]


def test_test_modules_have_distinct_names():
    """pytest imports each test file as a top-level module of its own name (tests/ holds no __init__.py):
    two files of one name in different folders would clash."""
    names = [path.name for path in (REPO / "tests").rglob("*.py")]
    assert sorted(names) == sorted(set(names)), sorted(name for name in set(names) if names.count(name) > 1)


def test_the_tests_import_internals_only_through_cosdistill_testing():
    """Every module under tests/ reaches the package's private modules through cosdistill.testing alone."""
    assert_public_imports_only(sorted(set((REPO / "tests").rglob("*.py")) - set(BENCHMARK_FILES)))


def test_the_benchmarks_import_internals_only_through_cosdistill_testing():
    assert_public_imports_only(BENCHMARK_FILES)


def test_importing_the_package_imports_neither_triton_nor_dynamo():
    """``import cosdistill`` (and cosdistill.testing, which conftest imports) leaves Triton and torch._dynamo alone:
    Triton reads TRITON_INTERPRET once, when it is imported, and the GPU tests unset it after conftest's imports
    (pytest -m gpu ran every kernel in the interpreter's mode, and failed, when a decorator at import brought them
    in); torch._dynamo alone takes longer to import than the package."""
    code = ("import sys, cosdistill, cosdistill.testing; "
            "print(sorted(name for name in ('triton', 'torch._dynamo') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
