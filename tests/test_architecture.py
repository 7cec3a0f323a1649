"""The shape of the code: layers whose imports point one way, no import cycles, short functions, the data path readable
top to bottom.

Read statically (ast), so the checks see imports inside functions too (the lazy imports that keep an
agent light must not hide a cycle); the data path's call chains are watched while a token is decoded.
"""

import ast
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"halo": "halo", "predictors": "halo.predictors", "scheduler": "halo.scheduler",
            "transport": "halo.transport", "edge_agent": "halo.edge_agent", "rpi": "halo.rpi", "eval": "halo.eval"}
# The packages, lowest layer first: a package imports from packages of lower layers only (docs/architecture.md).
LAYERS = (
    ("halo",),  # the root: errors, and the values people type (arguments)
    ("halo.host",),  # cores, memory, the cache directory
    ("halo.model",),  # what a model is and how it is read
    ("halo.compute",),  # what a device computes: kernels, neuron groups, its share, the reference model
    ("halo.predictors", "halo.generation"),  # ranking groups; turning logits into text
    ("halo.transport",),  # wire, UDP, reliable messages, control messages
    ("halo.sync",),  # a round's framing and the sync modes over the transport
    ("halo.scheduler",),  # plans from device profiles and the model's shape
    ("halo.runtime",),  # what both runtimes share: local agents, measuring a device, re-planning
    ("halo.pipeline",),  # the pipeline runtime
    ("halo.distributed", "halo.edge_agent"),  # the tensor-parallel master and the agent
    ("halo.serve",),  # the HTTP server
    ("halo.cli", "halo.rpi"),  # the coordinator's command line; deployment and the test bed
    ("halo.eval",),  # benchmarks, accuracy runs, fuzzing, reports
)
MAX_FUNCTION_LINES = 80
# the modules one token's data path runs through: each function fits on a screen
DATA_PATH = {"halo.distributed.master", "halo.distributed.rounds", "halo.edge_agent.rounds", "halo.compute.worker",
             "halo.transport.udp.base", "halo.transport.udp.send", "halo.transport.udp.gather",
             "halo.transport.udp.whole", "halo.transport.udp.probes", "halo.sync.modes", "halo.sync.framing"}
MAX_DATA_PATH_LINES = 60


def modules():
    """(module name, path, parsed tree) of every module of the package (tests/ aside)."""
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join([package, *parts]), path, ast.parse(path.read_text())


def imported(name: str, path: Path, tree: ast.AST) -> set[str]:
    """Every halo module a module imports, at module level or inside functions."""
    found = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module or ""
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {m for m in found if m.startswith("halo")}


def package_of(module: str) -> str:
    """The layer table's package a module belongs to (the longest prefix)."""
    known = [p for layer in LAYERS for p in layer if module == p or module.startswith(p + ".")]
    assert known, f"{module} belongs to no package of LAYERS: give its package a layer"
    return max(known, key=len)


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the module imports behind it."""
    graph = {name: imported(name, path, tree) for name, path, tree in modules()}
    edges = {}
    for name, deps in graph.items():
        for dep in deps:
            if dep in graph and package_of(dep) != package_of(name):
                edges.setdefault((package_of(name), package_of(dep)), []).append(f"{name} -> {dep}")
    return edges


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every cycle a depth-first walk meets, as 'a -> b -> a'."""
    state, found = {}, []

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                found.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_no_cycle_between_packages():
    graph = {}
    for a, b in package_edges():
        graph.setdefault(a, set()).add(b)
    assert cycles(graph) == []


def test_packages_import_only_from_lower_layers():
    layer = {p: i for i, packages in enumerate(LAYERS) for p in packages}
    upward = [f"{a} (layer {layer[a]}) imports {b} (layer {layer[b]}): {', '.join(sorted(why)[:3])}"
              for (a, b), why in sorted(package_edges().items()) if layer[b] >= layer[a]]
    assert upward == []


def test_no_import_cycles():
    graph = {name: imported(name, path, tree) for name, path, tree in modules()}
    assert cycles({name: {d for d in deps if d in graph and d != name} for name, deps in graph.items()}) == []


def test_functions_are_short():
    too_long = []
    for name, _, tree in modules():
        if name.startswith("halo.eval"):
            continue  # benchmarks and reports, not the product's code
        limit = MAX_DATA_PATH_LINES if name in DATA_PATH else MAX_FUNCTION_LINES
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    too_long.append(f"{name}.{node.name}: {lines} lines (limit {limit})")
    assert too_long == []


def test_master_and_agent_share_one_worker_and_neither_imports_the_other():
    graph = {name: imported(name, path, tree) for name, path, tree in modules()}
    agent = {d for m, deps in graph.items() if m.startswith("halo.edge_agent") for d in deps}
    assert not any(d.startswith("halo.distributed") for d in agent)
    assert "halo.compute.worker" in graph["halo.distributed.master"] and "halo.compute.worker" in graph["halo.edge_agent.agent"]


def test_every_halo_child_process_starts_with_the_installed_package_first():
    """From a checkout's root, `python -m halo.X` would import the source folder halo/ (no edge_agent, eval,
    scheduler inside) instead of the installed package: children start through module_command (-P)."""
    offenders = []
    for folder in [*PACKAGES, "eval"]:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.List) and len(node.elts) >= 3:
                    values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts[:3]]
                    if "-m" in values and any(isinstance(v, str) and v.startswith("halo") for v in values):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"start halo children with halo.distributed.module_command: {offenders}"


def module_stack(frame) -> list[str]:
    """The product modules on a call stack, outermost first, a run of frames in one module counted once."""
    modules = []
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("halo.") and not name.startswith("halo.eval") and (not modules or modules[-1] != name):
            modules.append(name)
        frame = frame.f_back
    return modules[::-1]


@pytest.mark.parametrize("mode", ["exact", "halo"])
def test_a_decode_tokens_data_path_returns_to_a_module_at_most_twice_on_each_side(stories_weights, mode):
    """Read top to bottom: while a token is decoded over an agent, no call chain on the master or on the agent goes
    back into a module it already passed through more than twice (a module calling down, and the callee calling back
    up into it: callbacks, upcalls). Measured on every call the profiler sees, master and agent in one process."""
    import signal
    import sys
    import threading

    from halo.distributed import cluster_model
    from halo.edge_agent import agent as agent_module
    from halo.sync import SyncSettings

    worst, calls, recording = {}, {"master": 0, "agent": 0}, threading.Event()

    def profile(frame, event, arg):
        if event != "call" or not recording.is_set():
            return
        side = "agent" if threading.current_thread().name == "agent" else "master"
        modules = module_stack(frame)
        calls[side] += 1
        returns = len(modules) - len(set(modules))
        if returns > worst.get(side, (0, []))[0]:
            worst[side] = (returns, modules)

    sigterm = signal.getsignal(signal.SIGTERM)
    agent = agent_module.Agent(None, "tcp://127.0.0.1:0", None, insecure=True, name="in-process")
    signal.signal(signal.SIGTERM, sigterm)  # the daemon takes SIGTERM for its drain: give it back to pytest
    def serve():
        sys.setprofile(profile)  # set in the thread itself (threading.setprofile races a thread's start)
        agent.serve()

    server = threading.Thread(target=serve, daemon=True, name="agent")
    server.start()
    model = cluster_model(stories_weights, [agent.endpoint], insecure=True, context=64, plan="even",
                          sync=SyncSettings(mode=mode))
    try:
        logits = model.forward([1, 2, 3])
        sys.setprofile(profile)
        recording.set()
        for _ in range(2):
            logits = model.forward([int(np.argmax(logits))])
    finally:
        recording.clear()
        sys.setprofile(None)
        model.close()
        agent.stop()
        server.join(5)
    assert calls["master"] > 500 and calls["agent"] > 500  # both sides were seen
    for side, (returns, modules) in worst.items():
        assert returns <= 2, f"{side}: {' -> '.join(modules)}"
