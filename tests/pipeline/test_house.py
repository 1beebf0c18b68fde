"""The shape of the code, checked: the base layer imports nothing else of capline, storage alone tells
local from bucket, stages meet through the registry, no modules import each other, directly or in a ring,
and no stage imports Ray (the executor and infra/remote.py decide how work runs)."""
import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("infra", "pipeline", "stages", "trainers")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every capline module `name` imports, at any depth of the file (function-level imports too)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name:
                found.add(t)
    return found


def test_the_base_layer_imports_nothing_else_of_capline():
    mods = _modules()
    known = set(mods)
    for name, path in mods.items():
        if name.startswith("infra"):
            outside = {m for m in _imports(name, path, known) if not m.startswith("infra")}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_no_two_modules_import_each_other():
    mods = _modules()
    known = set(mods)
    graph = {name: _imports(name, path, known) for name, path in mods.items()}
    pairs = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps
                    if a in graph.get(b, set()) and not (a.endswith("__init__") or b == a.rsplit(".", 1)[0]
                                                       or a == b.rsplit(".", 1)[0])})
    assert not pairs, f"modules that import each other: {pairs}"


def test_no_import_cycle_of_any_length():
    """Modules import in layers: no chain of imports (function-level ones too) leads back to where
    it started. A package and its own modules are one place (an __init__ re-exports them)."""
    mods = _modules()
    known = set(mods)
    graph = {n: {d for d in _imports(n, p, known) if not (n.startswith(d + ".") or d.startswith(n + "."))}
             for n, p in mods.items()}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):      # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
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
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"modules in an import cycle: {cycles}"


def _third_party_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_no_stage_uses_ray_directly():
    """Stages say what to compute; tasks, actor pools, shared actors and objects are made by the
    executor (pipeline/executor.py, through StageContext) and infra/remote.py. A stage that imported
    Ray would decide for itself how its work runs, out of the executor's sizing and accounting."""
    users = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "stages").rglob("*.py") if "ray" in _third_party_imports(p))
    assert not users, f"stages that import ray (use the executor through ctx, or infra/remote.py): {users}"
    # the check itself finds an import at any depth
    probe = ROOT / "stages" / "base.py"
    assert "pyarrow" in _third_party_imports(probe)


def test_one_loop_keeps_the_clusters_calls_in_flight():
    """Tasks, a model's actor pool, a shuffle's maps and its reducers all run through one loop
    (pipeline/task_window.drive): only it says a stall, and only it writes a run's record; the
    slots only submit, wait and take. No result carries data for later tasks but as a typed
    `Stored` field (no `aside` attribute, no sentinel string)."""
    product = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    stalls = [str(p.relative_to(ROOT)) for p in product if ".stalled(" in p.read_text()]
    records = [str(p.relative_to(ROOT)) for p in product if '"cluster_cpus":' in p.read_text()]
    assert stalls == ["pipeline/task_window.py"] and records == ["pipeline/task_window.py"], (stalls, records)
    asides = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in product for n in ast.walk(ast.parse(p.read_text()))
              if isinstance(n, ast.Attribute) and n.attr == "aside"]
    assert not asides, f"results that set data aside by attribute (use infra.remote.Stored): {asides}"
    # the loop's module is the engine's: it imports no stage
    tree = ast.parse((ROOT / "pipeline" / "task_window.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("stages")]


# functions that import Ray Data or Ray Train only in Ray's workers, where no other thread imports
WORKER_ONLY = {("pipeline/ray_shuffle.py", "_warm_worker"), ("trainers/loop.py", "_train")}


def _unguarded_ray_data_imports(rel: str, source: str) -> list[str]:
    """Imports of ray.data / ray.train (Ray Train imports Ray Data) in the module `rel` (its
    `source`) outside a `with importing_ray_data():` block and outside WORKER_ONLY's functions:
    'file:line function'."""
    found = []

    def visit(node, function: str, guarded: bool):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.With) and any(isinstance(i.context_expr, ast.Call) and
                                              getattr(i.context_expr.func, "id", "") == "importing_ray_data"
                                              for i in node.items):
            guarded = True
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        if (any(n.split(".")[:2] in (["ray", "data"], ["ray", "train"]) for n in names)
                and not guarded and (rel, function) not in WORKER_ONLY):
            found.append(f"{rel}:{node.lineno} {function}")
        for child in ast.iter_child_nodes(node):
            visit(child, function, guarded)

    visit(ast.parse(source), "<module>", False)
    return found


def test_ray_data_is_imported_under_one_lock_in_the_driver():
    """The driver imports Ray Data in two threads (the shuffles' warm-up, and the command's first
    shuffle or training): each import goes through infra/remote.py's lock, or one thread reads the
    other's half-imported package (CI on bedb6a2: "module 'ray.data' has no attribute '_internal'")."""
    free = [f for pkg in PACKAGES if pkg != "stages" for p in sorted((ROOT / pkg).rglob("*.py"))
            if p != ROOT / "infra" / "remote.py"
            for f in _unguarded_ray_data_imports(str(p.relative_to(ROOT)), p.read_text())]
    assert not free, f"imports of Ray Data outside `with importing_ray_data():` (infra/remote.py): {free}"
    # the check itself finds one at any depth, and sees the lock and the worker-only functions
    probe = ("def f():\n    if 1:\n        from ray.train import x\n"
             "def g():\n    with importing_ray_data():\n        import ray.data\n"
             "def _train():\n    import ray.train.torch\n")
    assert _unguarded_ray_data_imports("probe.py", probe) == ["probe.py:3 f", "probe.py:8 _train"]
    assert _unguarded_ray_data_imports("trainers/loop.py", probe) == ["trainers/loop.py:3 f"]


def test_only_storage_tells_a_local_folder_from_a_bucket():
    users = [str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
             if "is_local" in p.read_text() and p != ROOT / "infra" / "storage.py"]
    assert not users, f"branch on storage.is_local outside infra/storage.py: {users}"


def test_the_registry_is_the_one_list_of_stages():
    from pipeline import audit, dataset_card, report
    from pipeline.config import RunConfig
    from stages.registry import STAGES, by_name

    assert len({s.name for s in STAGES}) == len(STAGES)
    assert all(s.kind in ("source", "filter", "decide", "sink") for s in STAGES)
    assert [f for f in RunConfig().stages.__dataclass_fields__] == [s.config_key for s in STAGES if s.config_key]
    assert report.FILTER_STAGES == tuple(s.name for s in STAGES if s.kind in ("filter", "decide"))
    assert dataset_card.FILTERS == tuple(s.name for s in STAGES if s.thresholds)
    assert set(audit._audits()) == {s.name for s in STAGES if s.audits}
    assert [s.name for s in STAGES if s.final_data] == ["shard"] and by_name("shard").kind == "sink"
    # nothing else spells the list out: no module names four stages in one literal
    names = {s.name for s in STAGES}
    for pkg in ("pipeline", "stages"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                    literal = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                    assert len(literal & names) < 4 or path.name == "registry.py", \
                        f"{path.relative_to(ROOT)}:{node.lineno} lists stages itself: {sorted(literal & names)}"


@functools.lru_cache(maxsize=None)     # a module is imported from by many files: parsed once
def _top_names(path: Path) -> set[str]:
    """What a module defines or imports at its top level: what `from it import name` can take."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def test_benchmarks_and_tests_import_only_what_exists():
    """Scripts outside the packages are not imported by the suite (a benchmark runs for minutes), so a
    module moved inside capline would break them silently: benchmarks/train.py, which gpu.sh runs on
    a lent GPU, still took `synthetic` from `stages` after the stages moved into families."""
    mods = _modules()
    missing = []
    for path in sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tests").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if node.module.split(".")[0] not in PACKAGES:
                continue
            if node.module not in mods:
                missing.append(f"{path.relative_to(ROOT)}: {node.module}")
                continue
            defined = _top_names(mods[node.module])
            for a in node.names:
                if a.name != "*" and a.name not in defined and f"{node.module}.{a.name}" not in mods:
                    missing.append(f"{path.relative_to(ROOT)}: {node.module}.{a.name}")
    assert not missing, f"imports of names capline does not have: {missing}"
