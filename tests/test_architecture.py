"""The package's shape: imports flow one way, with no cycles and no reaching into privates.

Every module under ``pipeline/`` and ``jobs/`` is parsed (never imported) and every
import statement in it counts, lazy ones inside functions included. The rules are the
data just below; the helpers after them are pure functions over source text and
graphs, each with tests of its own at the end of this file.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import os

import pytest

from pipeline.model import families as families_registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pipeline", "jobs")  # the trees that are checked (tests/ may import anything)

# Ranks, lowest first. A module may import its own unit or any lower rank. A unit is a
# subpackage of pipeline/ (``pipeline.core.settings`` -> "core"), the package root
# ``pipeline`` itself (``__version__``), or "jobs" for everything under jobs/.
LAYERS = (
    ("pipeline",),
    ("core",),
    ("io",),
    ("model", "output"),
    ("plan", "generate"),
    ("collect",),
    ("engines",),
    ("cloud",),
    ("jobs",),
)
# Units of one rank are peers. They may not import each other: the model does not know
# how images are written, and planning does not know how they are generated.
PEERS_MAY_IMPORT = False
# Leaves sit outside the ranks: they may import any unit but jobs, and nothing in
# pipeline/ imports them. Each maps to the other leaves it may import.
LEAVES = {"bench": ("testing",), "testing": ()}
LEAF_IMPORTERS = ("jobs",)  # the units outside the leaves that may import a leaf
# A ``_private`` name of these packages is used only inside its own module. (Third-party
# internals such as ``jax._src`` are a separate, commented decision at each use.)
PRIVATE_RULE_PACKAGES = PACKAGES


# ---------------------------------------------------------------------------------------
# Pure helpers


@dataclasses.dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module (a package's __init__ is the package's name)
    line: int


def module_name(relative_path: str) -> tuple[str, bool]:
    """``pipeline/core/settings.py`` -> ("pipeline.core.settings", False); a package's
    ``__init__.py`` -> (the package's name, True)."""
    parts = relative_path.replace(os.sep, "/").removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from`` import names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_names(source: str, module: str, is_package: bool = False) -> list[tuple[int, str, str | None]]:
    """Every import in ``source``, at any depth: (line, module, name).

    ``import a.b`` gives (line, "a.b", None); ``from a import b`` gives (line, "a", "b");
    relative imports are made absolute against ``module``.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            found += [(node.lineno, base, alias.name) for alias in node.names]
    return sorted(found, key=lambda item: (item[0], item[1], item[2] or ""))


def _is_ours(name: str, packages=PACKAGES) -> bool:
    return name.split(".")[0] in packages


def resolve(module: str, name: str | None, modules: set[str]) -> str | None:
    """The module of ours that an import loads, or None for a third-party one.

    ``from a import b`` loads ``a.b`` when that is a module, else ``a`` (b is a name in
    it). Raises LookupError for an import of ours that names no module. The parent
    packages that Python initialises on the way are not counted: an ``__init__`` is a
    module of its own, and its imports are edges of their own.
    """
    if not _is_ours(module):
        return None
    if name is not None and name != "*" and f"{module}.{name}" in modules:
        return f"{module}.{name}"
    if module in modules:
        return module
    raise LookupError(module)


def edges_of(source: str, module: str, is_package: bool, modules: set[str]) -> tuple[list[Edge], list[str]]:
    """(edges to our modules, messages for imports of ours that name no module)."""
    edges, unknown = [], []
    for line, target, name in imported_names(source, module, is_package):
        try:
            resolved = resolve(target, name, modules)
        except LookupError as e:
            unknown.append(f"{module}:{line}: imports {e.args[0]}, which is no module of ours")
            continue
        if resolved is not None and resolved != module and Edge(module, resolved, line) not in edges:
            edges.append(Edge(module, resolved, line))
    return edges, unknown


def unit(module: str) -> str:
    """The unit a module belongs to: "jobs", "pipeline" (the root package), or a subpackage."""
    parts = module.split(".")
    if parts[0] == "jobs":
        return "jobs"
    return parts[1] if len(parts) > 1 else parts[0]


def rank(unit_name: str, layers=LAYERS) -> int | None:
    for index, units in enumerate(layers):
        if unit_name in units:
            return index
    return None


def layer_problem(source: str, target: str, layers=LAYERS, leaves=LEAVES, leaf_importers=LEAF_IMPORTERS,
                  peers_may_import=PEERS_MAY_IMPORT) -> str | None:
    """Why ``source`` may not import ``target``, or None when it may."""
    a, b = unit(source), unit(target)
    if a == b:
        return None
    for name in (a, b):
        if name not in leaves and rank(name, layers) is None:
            return f"unit {name!r} is neither in LAYERS nor in LEAVES"
    if b == "jobs" and a != "jobs":
        return "nothing in pipeline/ imports jobs/"
    if b in leaves:
        if a in leaf_importers or b in leaves.get(a, ()):
            return None
        return f"{b} is a leaf: only {', '.join(leaf_importers)} (and the leaves allowed in LEAVES) import it"
    if a in leaves:
        return None
    ra, rb = rank(a, layers), rank(b, layers)
    if rb > ra:
        return f"upward: {a} is below {b}"
    if rb == ra and not peers_may_import:
        return f"peers: {a} and {b} share a rank and do not import each other"
    return None


def layer_violations(edges: list[Edge], **rules) -> list[str]:
    messages = []
    for edge in edges:
        problem = layer_problem(edge.source, edge.target, **rules)
        if problem:
            messages.append(f"{edge.source}:{edge.line}: imports {edge.target} ({problem})")
    return messages


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one node, each sorted."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def a_cycle(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """One shortest cycle through ``members[0]`` inside the component: [a, b, ..., a]."""
    inside, start = set(members), members[0]
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == start:
                return path + [start]
            if nxt in inside and nxt not in seen:
                seen.add(nxt)
                paths.append(path + [nxt])
    raise ValueError(f"{members} is not a cycle")


def cycle_violations(edges: list[Edge]) -> list[str]:
    graph, lines = {}, {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        lines.setdefault((edge.source, edge.target), edge.line)
    messages = []
    for members in strongly_connected(graph):
        cycle = a_cycle(graph, members)
        steps = ", ".join(f"{a}:{lines[a, b]} imports {b}" for a, b in zip(cycle, cycle[1:]))
        message = f"import cycle {' -> '.join(cycle)} ({steps})"
        if len(members) > len(cycle) - 1:
            message += f"; the whole cycle group: {', '.join(members)}"
        messages.append(message)
    return messages


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _bound_modules(statements, module: str, is_package: bool, modules: set[str]) -> dict[str, str]:
    """Names that the imports among ``statements`` bind to modules (not descending into defs)."""
    bound = {}
    for node in _scope_nodes(statements):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules or not _is_ours(base):
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
    return bound


def _other_bindings(statements) -> set[str]:
    """Names a scope binds other than by import: assignments, loops, arguments, defs."""
    names = set()
    for node in _scope_nodes(statements):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _scope_nodes(statements):
    """Every node of a scope. A nested def, class or lambda is included, with what its
    scope evaluates (decorators, defaults, bases), but not its body."""
    pending = list(statements)
    while pending:
        node = pending.pop()
        yield node
        if isinstance(node, ast.ClassDef):
            pending += node.decorator_list + node.bases + [k.value for k in node.keywords]
        elif isinstance(node, _DEFS):
            pending += getattr(node, "decorator_list", []) + node.args.defaults + \
                [d for d in node.args.kw_defaults if d is not None]
        else:
            pending += ast.iter_child_nodes(node)


def _attribute_chain(node: ast.Attribute) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id] + parts[::-1]


def private_uses(source: str, module: str, is_package: bool = False, modules: set[str] = frozenset(),
                 packages=PRIVATE_RULE_PACKAGES) -> list[str]:
    """Uses of another module's ``_private`` name: ``from x import _y`` and ``mod._y``.

    ``mod`` is a name that an import binds to a module, in the same function or an
    enclosing one, and not rebound there by anything else.
    """
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            for alias in node.names:
                if _is_ours(base, packages) and base != module and _is_private(alias.name):
                    found.append((node.lineno, f"from {base} import {alias.name}"))

    def check(statements, outer: dict[str, str]):
        local = _bound_modules(statements, module, is_package, modules)
        rebound = _other_bindings(statements)
        visible = {name: target for name, target in outer.items() if name not in rebound}
        visible.update(local)
        for node in _scope_nodes(statements):
            if isinstance(node, ast.Attribute):
                chain = _attribute_chain(node)
                if chain and chain[0] in visible:
                    found.extend(_private_in_chain(chain, visible[chain[0]], node.lineno, module, modules,
                                                   packages))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                body = node.body if isinstance(node.body, list) else [node.body]
                check([node.args] + body, visible)
            elif isinstance(node, ast.ClassDef):
                check(node.body, visible)

    check(tree.body, {})
    return [f"{module}:{line}: uses {what}" for line, what in sorted(set(found))]


def _private_in_chain(chain, target, line, module, modules, packages):
    """``chain`` is [name, attr, attr, ...] with ``name`` bound to module ``target``."""
    if not _is_ours(target, packages) or target == module:
        return []
    current, written = target, chain[0]
    for attr in chain[1:]:
        if _is_private(attr):
            return [(line, f"{written}.{attr} (a private name of {current})")]
        if f"{current}.{attr}" not in modules:
            return []
        current, written = f"{current}.{attr}", f"{written}.{attr}"
    return []


# ---------------------------------------------------------------------------------------
# The tree


@functools.lru_cache(maxsize=None)
def _sources() -> dict[str, tuple[str, bool, str]]:
    """{module: (relative path, is_package, source)} for every module of PACKAGES."""
    found = {}
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for filename in sorted(files):
                if filename.endswith(".py"):
                    relative = os.path.relpath(os.path.join(folder, filename), ROOT)
                    name, is_package = module_name(relative)
                    with open(os.path.join(ROOT, relative), encoding="utf-8") as f:
                        found[name] = (relative, is_package, f.read())
    return found


@functools.lru_cache(maxsize=None)
def _tree_edges():
    sources = _sources()
    modules = set(sources)
    edges, unknown = [], []
    for name, (_, is_package, source) in sorted(sources.items()):
        found, missing = edges_of(source, name, is_package, modules)
        edges += found
        unknown += missing
    return sources, modules, edges, unknown


def _fail_with(title: str, messages: list[str]):
    if messages:
        pytest.fail(f"{title} ({len(messages)}):\n  " + "\n  ".join(messages), pytrace=False)


def test_the_tree_is_found():
    sources = _sources()
    assert {"pipeline.core.settings", "pipeline.model.load", "jobs.cli", "pipeline.core"} <= set(sources)
    assert all(unit(name) in LEAVES or rank(unit(name)) is not None for name in sources), \
        sorted(name for name in sources if unit(name) not in LEAVES and rank(unit(name)) is None)


def test_every_import_of_ours_names_a_module():
    _fail_with("imports of modules that do not exist", _tree_edges()[3])


def test_no_import_cycles():
    _fail_with("import cycles (lazy imports included)", cycle_violations(_tree_edges()[2]))


def test_imports_follow_the_layers():
    order = " -> ".join("/".join(units) for units in LAYERS)
    _fail_with(f"imports against the layers {order}; leaves {', '.join(LEAVES)}", layer_violations(_tree_edges()[2]))


def test_no_module_uses_another_modules_private_names():
    sources, modules, _, _ = _tree_edges()
    found = []
    for name, (_, is_package, source) in sorted(sources.items()):
        found += private_uses(source, name, is_package, modules)
    _fail_with("uses of another module's _private names", found)


FAMILIES = "pipeline.model.families"  # a family is one folder here; the package itself is the registry
FAMILY_NAMES = tuple(families_registry.BY_NAME)  # what no code outside the families may name


def family_of(module: str) -> str | None:
    """The family whose folder holds ``module`` (``pipeline.model.families.flux.sampling``
    -> "flux"), else None (the registry and its shared modules belong to no family)."""
    prefix = FAMILIES + "."
    if not module.startswith(prefix):
        return None
    rest = module[len(prefix):].split(".")
    return rest[0] if len(rest) > 1 else None


def family_seam_violations(edges: list[Edge], packages=(FAMILIES,)) -> list[str]:
    """Imports of a family's own modules from outside its folder: only the registry
    (``pipeline.model.families`` itself) imports a family."""
    found = []
    for edge in edges:
        owner = family_of(edge.target)
        if owner is not None and edge.source != FAMILIES and family_of(edge.source) != owner:
            found.append(f"{edge.source} (line {edge.line}) imports {edge.target}, {owner}'s own module: go through "
                         f"the registry ({FAMILIES}) and the Family interface")
    return found


def family_name_comparisons(source: str, names=FAMILY_NAMES) -> list[int]:
    """Lines of ``source`` that name a registered family in code: a string that is a
    family's name, compared (``== "flux"``, ``in ("sd", ...)``), a key or value of a
    literal, or an argument (docstrings aside): what a family is, and what it brings, must
    be asked of it, never told from its name."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return sorted({node.lineno for node in ast.walk(tree)
                   if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
                   and id(node) not in docstrings})


def test_only_the_registry_imports_a_family():
    _fail_with("imports of a family's own modules from outside its folder", family_seam_violations(_tree_edges()[2]))


def test_no_code_outside_the_families_compares_a_familys_name():
    found = [f"{relative} line {line}" for name, (relative, _, source) in sorted(_sources().items())
             if not name.startswith(FAMILIES) for line in family_name_comparisons(source)]
    _fail_with("comparisons with a family's name outside pipeline/model/families", found)


MOST_POSITIONAL = 6  # parameters before ``*`` (self and cls not counted) of a function in pipeline/model


def wide_functions(source: str, most: int = MOST_POSITIONAL) -> list[tuple[int, str, int]]:
    """(line, name, count) of every function of ``source`` with more than ``most``
    parameters before ``*``: a call of that many positions is a list to get wrong;
    group them (a request object) or make the rest keyword-only."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [a.arg for a in node.args.posonlyargs + node.args.args]
            if names and names[0] in ("self", "cls"):
                names = names[1:]
            if len(names) > most:
                found.append((node.lineno, node.name, len(names)))
    return found


def test_no_function_of_the_package_takes_more_than_six_positional_parameters():
    """Options after ``*``; what travels together is one object (the host's program is a
    ``generate.spec.ProgramSpec``, a host loop's sizes one ``host_loop.one_size``)."""
    found = [f"{relative} line {line}: {name} takes {count}" for module, (relative, _, source) in
             sorted(_sources().items()) if module.startswith("pipeline") for line, name, count in
             wide_functions(source)]
    _fail_with(f"functions of pipeline/ with more than {MOST_POSITIONAL} parameters before *", found)


def test_the_model_has_no_family_specific_field():
    import dataclasses as dc

    from pipeline.model.families.base import Model

    assert {f.name for f in dc.fields(Model)} == {"path", "fingerprint", "family", "nets", "sampler", "params",
                                                   "dtype", "latent_channels", "vae_scale_factor", "native_size",
                                                   "param_dtype", "default_steps"}


MOST_LINES = 500  # of a module of pipeline/ or jobs/: past it, a module does more than one job


def long_modules(sources: dict[str, tuple[str, bool, str]], most: int = MOST_LINES) -> list[str]:
    """``PATH: N lines`` of every module of ``sources`` ({module: (relative path, is_package,
    source)}) longer than ``most`` lines: split it into modules named by their roles."""
    return [f"{relative}: {len(source.splitlines())} lines" for relative, _, source in sorted(sources.values())
            if len(source.splitlines()) > most]


def test_no_module_is_over_500_lines():
    _fail_with(f"modules of pipeline/ and jobs/ over {MOST_LINES} lines", long_modules(_sources()))


# The rooms of pipeline/model, lowest first: a module imports its own room or a lower one,
# never an upper one (rooms of one rank do not import each other). ``load`` is the model's
# front door, above the families it asks; the scorers load a checkpoint's own safety checker
# through it.
MODEL = "pipeline.model"
MODEL_ROOMS = (("shapes",), ("sharding",), ("loading",), ("layers", "sampling"), ("families",), ("load",),
               ("scorers",))


def model_room(module: str) -> str | None:
    """The room of pipeline/model that holds ``module`` (``pipeline.model.families.flux.sampling``
    -> "families", ``pipeline.model.sharding`` -> "sharding"); None outside it, and for the
    package itself."""
    parts = module.split(".")
    return parts[2] if parts[:2] == MODEL.split(".") and len(parts) > 2 else None


def model_upward_arrows(edges: list[Edge], rooms=MODEL_ROOMS) -> list[str]:
    """Imports inside pipeline/model from a room to a higher one, or to another of its rank."""
    found = []
    for edge in edges:
        a, b = model_room(edge.source), model_room(edge.target)
        if a is None or b is None or a == b:
            continue
        ra, rb = rank(a, rooms), rank(b, rooms)
        if ra is None or rb is None:
            found.append(f"{edge.source}:{edge.line}: imports {edge.target} (room {a if ra is None else b!r} is not "
                         f"in MODEL_ROOMS)")
        elif rb >= ra:
            found.append(f"{edge.source}:{edge.line}: imports {edge.target} "
                         f"({'upward: ' + a + ' is below ' + b if rb > ra else 'peers: ' + a + ' and ' + b})")
    return found


def test_the_model_has_no_upward_arrow():
    sources = _sources()
    unplaced = sorted(name for name in sources if model_room(name) and rank(model_room(name), MODEL_ROOMS) is None)
    assert not unplaced, f"modules of pipeline/model in no room of MODEL_ROOMS: {unplaced}"
    _fail_with("imports from a room of pipeline/model up to a higher one", model_upward_arrows(_tree_edges()[2]))


# ---------------------------------------------------------------------------------------
# The helpers, on tiny synthetic sources and graphs


def test_model_rooms_and_their_arrows():
    assert model_room("pipeline.model.families.flux.sampling") == "families"
    assert model_room("pipeline.model.sharding") == "sharding"
    assert model_room("pipeline.model") is None and model_room("pipeline.generate.fit") is None
    edges = [Edge("pipeline.model.sharding", "pipeline.model.families.shapes", 1),  # the arrow issue 59 removed
             Edge("pipeline.model.loading.builtin", "pipeline.model.layers.text.qwen3", 2),
             Edge("pipeline.model.layers.vae", "pipeline.model.sampling.flow", 3),
             Edge("pipeline.model.families.qwen_text", "pipeline.model.layers.text.chat", 4),
             Edge("pipeline.model.scorers.models", "pipeline.model.load", 5),
             Edge("pipeline.model.sampling.decoding", "pipeline.model.sharding", 6),
             Edge("pipeline.generate.fit", "pipeline.model.shapes", 7)]
    assert model_upward_arrows(edges) == [
        "pipeline.model.sharding:1: imports pipeline.model.families.shapes (upward: sharding is below families)",
        "pipeline.model.loading.builtin:2: imports pipeline.model.layers.text.qwen3 (upward: loading is below layers)",
        "pipeline.model.layers.vae:3: imports pipeline.model.sampling.flow (peers: layers and sampling)"]
    assert model_upward_arrows([Edge("pipeline.model.nets.x", "pipeline.model.load", 1)]) == [
        "pipeline.model.nets.x:1: imports pipeline.model.load (room 'nets' is not in MODEL_ROOMS)"]


def test_wide_functions():
    source = ("def a(x, y, z, u, v, w, t): pass\ndef b(self, x, y, z, u, v, w): pass\n"
              "def c(x, y, z, u, v, w, *, t): pass\n")
    assert wide_functions(source) == [(1, "a", 7)]


def test_family_of_and_the_seam():
    assert family_of("pipeline.model.families.flux.sampling") == "flux"
    assert family_of("pipeline.model.families.base") is None and family_of("pipeline.model.families") is None
    assert family_of("pipeline.model.load") is None
    edges = [Edge("pipeline.model.load", "pipeline.model.families", 1),
             Edge("pipeline.model.families", "pipeline.model.families.sd.family", 2),
             Edge("pipeline.model.families.sd.family", "pipeline.model.families.sd.presets", 3),
             Edge("pipeline.generate.sampler", "pipeline.model.families.flux.sampling", 4),
             Edge("pipeline.model.families.flux.family", "pipeline.model.families.sd.presets", 5)]
    found = family_seam_violations(edges)
    assert len(found) == 2 and "pipeline.generate.sampler (line 4)" in found[0] and "(line 5)" in found[1]


def test_family_name_comparisons():
    source = ('"""The flux family, "flux"."""\na = x == "flux"\nb = "sdxl" != y\nc = z in ("sd", "other")\n'
              'd = name == "fluxion"\ne = {"flux": 1}\nf = x is None\ng = rule("zimage")\n')
    assert family_name_comparisons(source) == [2, 3, 4, 6, 8]
    assert set(FAMILY_NAMES) >= {"sd", "sdxl", "flux", "flux2", "zimage"}  # read from the registry

MODULES = {"pipeline", "pipeline.core", "pipeline.core.keys", "pipeline.core.settings", "pipeline.io",
           "pipeline.io.storage", "pipeline.model", "pipeline.model.load", "pipeline.output",
           "pipeline.output.formats", "pipeline.plan", "pipeline.plan.inputs", "pipeline.generate",
           "pipeline.generate.host_loop", "pipeline.bench", "pipeline.bench.plan_scale", "pipeline.testing",
           "pipeline.testing.emulator", "jobs", "jobs.cli"}


@pytest.mark.parametrize("path, expected", [
    ("pipeline/core/settings.py", ("pipeline.core.settings", False)),
    ("pipeline/core/__init__.py", ("pipeline.core", True)),
    ("pipeline/__init__.py", ("pipeline", True)),
    ("jobs/cli.py", ("jobs.cli", False)),
])
def test_module_name(path, expected):
    assert module_name(path) == expected


def test_imported_names_sees_every_form_and_depth():
    source = ("import os\n"
              "import pipeline.core.keys\n"
              "from pipeline.io import storage\n"
              "from pipeline.model.load import DTYPES as D\n"
              "def f():\n"
              "    from pipeline.output import formats\n"
              "    class C:\n"
              "        def g(self):\n"
              "            import jobs.cli as c\n"
              "from . import keys\n"
              "from .keys import derive\n"
              "from .. import io\n")
    assert imported_names(source, "pipeline.core.settings") == [
        (1, "os", None), (2, "pipeline.core.keys", None), (3, "pipeline.io", "storage"),
        (4, "pipeline.model.load", "DTYPES"), (6, "pipeline.output", "formats"), (9, "jobs.cli", None),
        (10, "pipeline.core", "keys"), (11, "pipeline.core.keys", "derive"), (12, "pipeline", "io")]
    assert imported_names("from . import keys\n", "pipeline.core", is_package=True) == [
        (1, "pipeline.core", "keys")]


def test_resolve_prefers_a_submodule_then_the_package():
    assert resolve("pipeline.io", "storage", MODULES) == "pipeline.io.storage"
    assert resolve("pipeline.model.load", "DTYPES", MODULES) == "pipeline.model.load"
    assert resolve("pipeline", "__version__", MODULES) == "pipeline"
    assert resolve("pipeline.core.keys", None, MODULES) == "pipeline.core.keys"
    assert resolve("numpy", "ndarray", MODULES) is None
    with pytest.raises(LookupError, match="pipeline.model.gone"):
        resolve("pipeline.model.gone", "x", MODULES)


def test_a_lazy_import_is_an_edge():
    source = "import os\n\ndef run():\n    from pipeline.io import storage\n    return storage\n"
    edges, unknown = edges_of(source, "pipeline.core.keys", False, MODULES)
    assert edges == [Edge("pipeline.core.keys", "pipeline.io.storage", 4)] and unknown == []
    assert layer_violations(edges) == [
        "pipeline.core.keys:4: imports pipeline.io.storage (upward: core is below io)"]


def test_an_import_of_a_missing_module_of_ours_is_reported():
    _, unknown = edges_of("def f():\n    from pipeline.model.tiny import build\n", "pipeline.model.load", False,
                          MODULES)
    assert unknown == ["pipeline.model.load:2: imports pipeline.model.tiny, which is no module of ours"]


@pytest.mark.parametrize("source, target, problem", [
    ("pipeline.io.storage", "pipeline.core.keys", None),
    ("pipeline.core.keys", "pipeline.core.settings", None),
    ("pipeline.plan.inputs", "pipeline.model.load", None),
    ("pipeline.output.formats", "pipeline", None),
    ("jobs.cli", "pipeline.bench.plan_scale", None),
    ("jobs.cli", "pipeline.generate.host_loop", None),
    ("pipeline.bench.plan_scale", "pipeline.testing.emulator", None),
    ("pipeline.bench.plan_scale", "pipeline.generate.host_loop", None),
    ("pipeline.core.settings", "pipeline.output.formats", "upward: core is below output"),
    ("pipeline.model.load", "pipeline.output.formats", "peers: model and output share a rank"),
    ("pipeline.plan.inputs", "pipeline.generate.host_loop", "peers: plan and generate share a rank"),
    ("pipeline.generate.host_loop", "pipeline.bench.plan_scale", "bench is a leaf"),
    ("pipeline.testing.emulator", "pipeline.bench.plan_scale", "bench is a leaf"),
    ("pipeline.bench.plan_scale", "jobs.cli", "nothing in pipeline/ imports jobs/"),
    ("pipeline.io.storage", "jobs.cli", "nothing in pipeline/ imports jobs/"),
    ("pipeline.extras.thing", "pipeline.core.keys", "unit 'extras' is neither in LAYERS nor in LEAVES"),
])
def test_layer_problem(source, target, problem):
    found = layer_problem(source, target)
    assert found == problem if problem is None else found.startswith(problem)


def test_peers_may_import_each_other_when_the_rules_say_so():
    assert layer_problem("pipeline.model.load", "pipeline.output.formats", peers_may_import=True) is None


def test_cycles_are_found_and_spelled_out():
    edges = [Edge("a", "b", 1), Edge("b", "c", 2), Edge("c", "a", 3), Edge("c", "d", 4), Edge("d", "e", 5),
             Edge("x", "y", 6), Edge("y", "x", 7)]
    assert cycle_violations(edges) == [
        "import cycle a -> b -> c -> a (a:1 imports b, b:2 imports c, c:3 imports a)",
        "import cycle x -> y -> x (x:6 imports y, y:7 imports x)"]
    assert cycle_violations(edges[:2] + edges[3:5]) == []


def test_a_cycle_group_larger_than_the_cycle_shown_is_listed():
    edges = [Edge("a", "b", 1), Edge("b", "a", 2), Edge("b", "c", 3), Edge("c", "b", 4)]
    assert strongly_connected({"a": {"b"}, "b": {"a", "c"}, "c": {"b"}}) == [["a", "b", "c"]]
    assert cycle_violations(edges) == [
        "import cycle a -> b -> a (a:1 imports b, b:2 imports a); the whole cycle group: a, b, c"]


def test_a_lazy_cycle_is_a_cycle():
    load = "def resolve():\n    from pipeline.model import tiny\n"
    tiny = "def build():\n    from pipeline.model.load import quiet_libraries\n"
    modules = MODULES | {"pipeline.model.tiny"}
    edges = edges_of(load, "pipeline.model.load", False, modules)[0] + \
        edges_of(tiny, "pipeline.model.tiny", False, modules)[0]
    assert cycle_violations(edges) == [
        "import cycle pipeline.model.load -> pipeline.model.tiny -> pipeline.model.load "
        "(pipeline.model.load:2 imports pipeline.model.tiny, pipeline.model.tiny:2 imports pipeline.model.load)"]


def test_private_names_from_import():
    source = ("from pipeline.collect.transforms import _count_rejects, Collect\n"
              "from pipeline import __version__\n"
              "from jax._src import dispatch\n"
              "from numpy import _private_thing\n"
              "def f():\n"
              "    from .load import _to_bf16\n")
    assert private_uses(source, "pipeline.model.tiny", modules=MODULES) == [
        "pipeline.model.tiny:1: uses from pipeline.collect.transforms import _count_rejects",
        "pipeline.model.tiny:6: uses from pipeline.model.load import _to_bf16"]


def test_private_names_through_a_module_name():
    source = ("import pipeline.io.storage\n"
              "from pipeline.generate import host_loop as host\n"
              "from pipeline.io import storage\n"
              "from pipeline.core.keys import derive\n"
              "import numpy as np\n"
              "storage._gcs_client.cache_clear()\n"
              "pipeline.io.storage._gcs_client()\n"
              "def f(generator):\n"
              "    return host._batch(generator), host.run(), host.__name__, np._private, derive._cache\n"
              "def g():\n"
              "    from pipeline.io import storage as s\n"
              "    return s._retry\n"
              "import pipeline.generate.host_loop as hl\n"
              "hl._batch\n")
    assert private_uses(source, "pipeline.bench.upload", modules=MODULES) == [
        "pipeline.bench.upload:6: uses storage._gcs_client (a private name of pipeline.io.storage)",
        "pipeline.bench.upload:7: uses pipeline.io.storage._gcs_client (a private name of pipeline.io.storage)",
        "pipeline.bench.upload:9: uses host._batch (a private name of pipeline.generate.host_loop)",
        "pipeline.bench.upload:12: uses s._retry (a private name of pipeline.io.storage)",
        "pipeline.bench.upload:14: uses hl._batch (a private name of pipeline.generate.host_loop)"]


def test_private_names_of_objects_and_of_the_module_itself_are_fine():
    source = ("import os\n"
              "from pipeline.io import storage\n"
              "from pipeline.core import keys\n"
              "class Fn:\n"
              "    def setup(self):\n"
              "        self._client = storage.client()\n"
              "def f(storage):\n"  # an argument shadows the module
              "    return storage._client\n"
              "def g():\n"
              "    keys = object()\n"  # so does an assignment
              "    return keys._x\n"
              "def h(proxy):\n"
              "    return proxy._pick_fault()\n")
    assert private_uses(source, "pipeline.plan.inputs", modules=MODULES) == []
    assert private_uses("from pipeline.core import keys\nkeys._cache\n", "pipeline.core.keys", modules=MODULES) \
        == []


def test_long_modules():
    sources = {"pipeline.a": ("pipeline/a.py", False, "x = 1\n" * 3), "pipeline.b": ("pipeline/b.py", False, "y\n" * 4),
               "pipeline": ("pipeline/__init__.py", True, "")}
    assert long_modules(sources, most=3) == ["pipeline/b.py: 4 lines"]
    assert long_modules(sources, most=4) == []
