"""The layering the folders promise: no import cycles between the project's modules, Ray only in deploy/ and bench/,
and vLLM, a peer engine the project never installs, only in bench/peers/."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "prefetch", "routing", "deploy", "bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports() -> dict[str, set[str]]:
    """module -> the project modules it imports at module level or inside functions (TYPE_CHECKING blocks too)."""
    modules = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done, on_path = set(), []

    def visit(node: str) -> list[str] | None:
        if node in on_path:
            return on_path[on_path.index(node):] + [node]
        if node in done:
            return None
        on_path.append(node)
        for nxt in sorted(graph[node]):
            if cycle := visit(nxt):
                return cycle
        on_path.pop()
        done.add(node)
        return None

    return next((c for c in map(visit, sorted(graph)) if c), None)


def test_no_import_cycles():
    assert find_cycle(project_imports()) is None


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def imported_names(path: Path) -> set[str]:
    """Every absolute module name that `path` imports, anywhere in it."""
    tree = ast.parse(path.read_text(), str(path))
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return names | {node.module for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}


def imports_package(path: Path, package: str) -> bool:
    return any(n == package or n.startswith(f"{package}.") for n in imported_names(path))


def test_only_deploy_and_bench_import_ray():
    for package in ("app", "prefetch", "routing"):
        for path in (ROOT / package).rglob("*.py"):
            assert not imports_package(path, "ray"), path


def test_only_bench_peers_imports_vllm():
    peers = ROOT / "bench" / "peers"
    for package in (*PACKAGES, "tests"):
        for path in (ROOT / package).rglob("*.py"):
            if peers not in path.parents:
                assert not imports_package(path, "vllm"), path
    assert imports_package(peers / "vllm.py", "vllm")  # the check sees the one module that does


def test_the_routing_policy_stands_alone():
    """routing/ is the router's policy and its wire values: the engine and the router import it, never the reverse."""
    graph = project_imports()
    for name, imported in graph.items():
        if name.startswith("routing"):
            assert all(m.startswith("routing") for m in imported), (name, imported)
