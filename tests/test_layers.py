"""The layers of docs/architecture.md, kept: each layer imports only the layers below it, and
there is no import circle among labkit's modules."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "labkit"

# what each layer may import from labkit (besides itself); theory and numerics: anyone may
ALLOWED = {
    "runtime": {"runtime", "theory", "numerics"},
    "parallel": {"parallel", "runtime", "theory", "numerics"},
    "theory": {"theory"},
    "viz": {"viz", "theory"},
}


def labkit_imports(path):
    """The labkit modules a file imports, as dotted names (relative imports resolved)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("labkit")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("labkit"):
                names.add(target)
    return module, names


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((PACKAGE / layer).glob("*.py")):
            module, names = labkit_imports(path)
            for name in names:
                parts = name.split(".")
                if len(parts) > 1 and parts[1] not in allowed:
                    wrong.append(f"{module} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_no_import_circles():
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        module, names = labkit_imports(path)
        graph[module] = {n for n in names if n != module}
    modules = set(graph)

    def resolve(name):    # `from labkit.parallel import x` may name a module or a package
        return name if name in modules else None

    state, circles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in filter(None, map(resolve, graph.get(node, ()))):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(modules):
        if module not in state:
            visit(module, [module])
    # a package's __init__ that re-exports lazily imports nothing, so a circle is a real one
    assert not circles, "\n".join(circles)
