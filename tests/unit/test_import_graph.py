"""The package's modules import only from below: no import circles.

Every import statement counts, including those under `TYPE_CHECKING` and
those inside functions: a circle there still means two modules that each
need the other, so neither can be read, tested or moved alone. The graph
is read from the source with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvfsm

PACKAGE = Path(kvfsm.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = ["kvfsm", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the kvfsm modules it imports (a package counts as its __init__)."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from . import _status` names a module; `from ._manager import X` the module.
                names = [f"{base}.{alias.name}" for alias in node.names]
                targets = [t for t in names if t in modules] or [base]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target in modules:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary circle through strongly connected modules (Tarjan's SCCs, then a walk)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_circles() -> None:
    graph = import_graph()
    assert graph["kvfsm._manager"] >= {"kvfsm._fastpath", "kvfsm._states"}  # the reader sees real edges
    assert cycles(graph) == []


def test_the_circle_finder_finds_circles() -> None:
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_endpoint_halves_run_without_pyzmq() -> None:
    """Only the transport imports zmq: the halves, the wire model's harness and a whole transfer run without it."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['zmq'] = None\n"  # `import zmq` now raises ImportError
        "import kvfsm\n"
        "from kvfsm.backends import remote, _remote_sender, _remote_receiver, _remote_writer, _sessions\n"
        "from tests.wire_sim import World\n"
        "world = World(decodes=1)\n"
        "p, d = world.prefill_manager.open(1), world.decode_managers[0].open(1)\n"
        "world.prefill.bootstrap(p, 'sim://prefill'); world.decodes[0].bootstrap(d, 'sim://prefill'); world.settle()\n"
        "world.decodes[0].expect(d, [1], aux_index=None); world.settle()\n"
        "world.prefill.send(p, [2], last=True); world.settle()\n"
        "assert (p.state.name, d.state.name) == ('Success', 'Success'), (p, d)\n"
        "assert 'zmq' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n"
    )
    root = PACKAGE.parent
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
