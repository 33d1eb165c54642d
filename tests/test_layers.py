"""The layers of docs/architecture.md, kept: each layer imports only the layers below it, the
techniques of parallel/ do not import each other, and there is no import circle among
labkit's modules. Static (the source's import statements, lazy ones included): nothing runs."""
import ast
import fnmatch
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "labkit"

# what each layer may import from labkit (besides itself). theory and numerics: anyone may;
# models and data (the lab's models and batches) import no labkit module. The entry points
# at the top (cli*, calibrate, doctor, gpu_check, editions) may import any layer; no layer
# imports them.
ALLOWED = {
    "runtime": {"theory", "numerics"},
    "parallel": {"runtime", "theory", "numerics"},
    "runs": {"parallel", "runtime", "theory", "numerics", "models", "data"},
    "exercises": {"parallel", "runtime", "theory", "numerics", "models", "data"},
    "theory": set(),
    "viz": {"theory"},
    "models": set(),
    "data": set(),
    "numerics": set(),
}

# parallel/: every module is one technique's (its block, the parts only it uses, and its
# Hugging Face adapter), shared (pieces several techniques are built from, holding no
# technique of their own), or the composer. A technique's module imports from parallel/ only
# its own technique's modules and shared ones; a shared module imports only shared ones;
# the composer (hybrid.py: the mesh, and mesh_dims.py, its degrees) may import any.
TECHNIQUES = {
    "data parallel (DDP)": ["data_parallel"],
    "ZeRO-1/2": ["zero"],
    "mixed precision (fp32 masters)": ["mixed_precision"],
    "fully sharded (ZeRO-3)": ["fully_shard*", "fsdp2"],
    "tensor parallel (+ SP, async TP)": ["tensor_parallel", "parallel_styles", "tp_presets",
                                         "async_tp"],
    "pipeline": ["pipeline", "zero_bubble", "hf_stages"],
    "expert parallel": ["moe", "moe_*", "expert_tp", "hf_experts"],
    "context parallel": ["context_parallelism", "ring_attention", "head_attention",
                         "context_batch"],
    "selective recompute": ["recompute"],
    "serving (generation)": ["serving", "hf_cache"],
    "continuous batching": ["batching"],
    "speculative decoding": ["speculative"],
    "disaggregated serving": ["disaggregated"],
    "prefix sharing": ["prefix_sharing"],
}
SHARED = {
    "mappings",              # the autograd collectives (f, g, gather/scatter, all-to-all rows)
    "flat",                  # flat buffers, buckets, gradient averages, unwrapped names
    "scoped_mode",           # the TorchFunctionMode on while chosen modules run (CP, recompute)
    "tensor_parallel_plan",  # reading a TP plan: which Linear splits how (TP and expert TP)
    "tp_shards",             # a weight's TP shard and its gathering back (TP and expert TP)
    "kv_cache",              # generation's KV cache (serving, the pipeline's HF adapter)
    "paged_kv",              # the paged KV cache and its ragged forward (the serving systems)
    "self_check",            # a block's check of itself on a miniature, against one device
}
COMPOSER = {"__init__", "hybrid", "mesh_dims"}


def labkit_imports(path):
    """(module, imports): the file's dotted module name and the labkit modules it imports,
    relative imports resolved; `from labkit.x import y` names `labkit.x.y` when y is a module."""
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
            if not target.startswith("labkit"):
                continue
            folder = PACKAGE.parent.joinpath(*target.split("."))
            for alias in node.names:
                child = folder / alias.name
                names.add(f"{target}.{alias.name}" if child.with_suffix(".py").exists()
                          or child.is_dir() else target)
    return module, names


def _modules():
    return [labkit_imports(p) for p in sorted(PACKAGE.rglob("*.py"))]


def _layer(dotted):
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else None


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for module, names in _modules():
        layer = _layer(module)
        if layer not in ALLOWED:
            continue
        for name in names:
            target = _layer(name)
            if target is not None and target != layer and target not in ALLOWED[layer]:
                wrong.append(f"{module} imports {name}")
    assert not wrong, "\n".join(wrong)


def role(name):
    """'shared', 'composer' or the technique a parallel/ module (its file name) belongs to."""
    if name in SHARED:
        return "shared"
    if name in COMPOSER:
        return "composer"
    found = [t for t, patterns in TECHNIQUES.items()
             if any(fnmatch.fnmatch(name, p) for p in patterns)]
    assert len(found) == 1, (f"parallel/{name}.py belongs to {found or 'no technique'}: name "
                             "its technique (or shared) in tests/test_layers.py and the table "
                             "of docs/architecture.md")
    return found[0]


def test_every_parallel_module_has_one_role():
    for path in (PACKAGE / "parallel").glob("*.py"):
        role(path.stem)


def test_techniques_do_not_import_each_other():
    wrong = []
    for module, names in _modules():
        if _layer(module) != "parallel" or module.count(".") != 2:
            continue
        mine = role(module.rsplit(".", 1)[1])
        for name in names:
            parts = name.split(".")
            if len(parts) != 3 or parts[1] != "parallel" or mine == "composer":
                continue
            theirs = role(parts[2])
            if theirs != "shared" and (mine == "shared" or theirs != mine):
                wrong.append(f"{module} ({mine}) imports {name} ({theirs})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("source, caught", [
    ("from .fully_shard import FullyShard", "parallel.moe (expert parallel) imports "
     "labkit.parallel.fully_shard (fully sharded (ZeRO-3))"),
    ("from . import context_parallelism", "imports labkit.parallel.context_parallelism"),
    ("from labkit.parallel.recompute import checkpoint_attention_cores", "parallel.recompute"),
])
def test_the_technique_rule_catches_a_crossing_import(tmp_path, monkeypatch, source, caught):
    """The rule above, shown failing: moe.py given one more import of another technique."""
    copy = tmp_path / "labkit"
    (copy / "parallel").mkdir(parents=True)
    for path in (PACKAGE / "parallel").glob("*.py"):
        (copy / "parallel" / path.name).write_text(path.read_text())
    moe = copy / "parallel" / "moe.py"
    moe.write_text(moe.read_text() + f"\n{source}\n")
    monkeypatch.setitem(globals(), "PACKAGE", copy)
    with pytest.raises(AssertionError, match=caught.replace("(", r"\(").replace(")", r"\)")):
        test_techniques_do_not_import_each_other()


def test_no_import_circles():
    graph = {module: {n for n in names if n != module} for module, names in _modules()}
    modules = set(graph)
    state, circles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in (n for n in graph.get(node, ()) if n in modules):
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
