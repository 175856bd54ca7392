"""The package's import floors: every module imports only from floors below its own (config, the
metrics and the small leaf modules import nothing of the package), and no modules import each other
in a cycle. Read from the source (every import statement, also inside functions; imports under
``if TYPE_CHECKING:`` are annotations only and do not count)."""

import ast
from pathlib import Path

PACKAGE = "megatron_bubblespec"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Lowest first. A module may import from its own subpackage and from lower floors only.
FLOORS = [
    {"config", "tokens", "cache", "splitmix", "machine", "logs", "metrics", "distributed",
     "registry"},
    {"sampling", "models", "cpu_runtime"},  # keyed sampler, request types; HF checkpoints; preload
    {"data", "train"},                      # tasks and rewards; Megatron model, GRPO, reshard
    {"speculative"},                        # verification rules, drafts, the Megatron verifier
    {"rollout"},                            # engines (they verify speculative continuations)
    {"preflight"},                          # input checks above config
    {"loop"},                               # the synchronous step and the training loop
    {"measure"},                            # benches, plain replay, simulator (apart from the core)
    {"cli"},
]
# (importing module, imported module) pairs that break a floor today and are being removed; the
# test below fails once one of them is gone, so that the entry goes too.
KNOWN: set[tuple[str, str]] = set()   # allowed exceptions to the floors (none)


def _floor(room: str) -> int:
    for level, rooms in enumerate(FLOORS):
        if room in rooms:
            return level
    raise AssertionError(f"{PACKAGE}.{room} is on no floor: add it to FLOORS in {__file__}")


def _type_checking(node) -> bool:
    test = node.test
    return isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING")


def _imports(tree) -> set[str]:
    found = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(PACKAGE))
        stack.extend(ast.iter_child_nodes(node))
    return found


def _graph() -> dict[str, set[str]]:
    """module (dotted, without the package) -> the package modules it imports."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(p for p in parts if p != "__init__") or "__init__"] = path
    graph = {}
    for name, path in modules.items():
        targets = set()
        for dotted in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            target = dotted[len(PACKAGE) + 1:]
            while target and target not in modules:   # "pkg.mod.Name" -> "pkg.mod"
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def _room(module: str) -> str:
    return module.split(".")[0]


def test_every_module_imports_only_from_lower_floors():
    graph = _graph()
    wrong = sorted(
        f"{source} (floor {_floor(_room(source))}) imports {target} (floor {_floor(_room(target))})"
        for source, targets in graph.items() if source != "__init__"
        for target in targets
        if _room(target) != _room(source) and _floor(_room(target)) >= _floor(_room(source))
        and (source, target) not in KNOWN)
    assert not wrong, "imports from the same or a higher floor:\n" + "\n".join(wrong)


def test_known_exceptions_are_still_needed():
    graph = _graph()
    gone = sorted(f"{s} -> {t}" for s, t in KNOWN if t not in graph.get(s, ()))
    assert not gone, f"remove from KNOWN in {__file__}: {gone}"


def test_no_modules_import_each_other_in_a_cycle():
    graph = _graph()
    state: dict[str, int] = {}        # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_floor_check_sees_a_violation():
    """The parser finds imports inside functions and ignores TYPE_CHECKING blocks."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
              "    from megatron_bubblespec.loop import step\n"
              "def f():\n    from megatron_bubblespec.rollout.base import RolloutEngine\n")
    assert _imports(ast.parse(source)) == {"megatron_bubblespec.rollout.base",
                                           "megatron_bubblespec.rollout.base.RolloutEngine"}
