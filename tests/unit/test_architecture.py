"""The code's boundaries, checked on its source: module and function sizes, and which package may import which.

Distributions and layers, bottom up: the client package ``fastexp`` (``client/``: the contract, records, wire
codec, the trainer's client, the experience math ``fastexp.rl``), ``services.common``, the three services (none
imports another), and the command line on top (``services.cli``, ``services.launcher``, ``services.demo``). The
client package needs only grpcio, protobuf, numpy and torch; its math (``fastexp.rl``) only torch and numpy.

Inside the experience service, packages by role: ``api`` (the gRPC edge: decoding, prompts, the servicer),
``pipeline`` (the stages and their records), ``workers`` (the models: forwards, log-probs, critic, offload,
vision), ``fleet`` (generator replicas, routing, clients, readiness), ``runs`` (runs, their owners and limits;
over ``state`` alone), ``state`` (the durable store shared by every replica; no other package), and ``config`` (the decoded request as plain values). Imports are followed transitively; imports
under ``if TYPE_CHECKING:`` are annotations, not dependencies. Each check reports every violation at once (one test
per rule, not one per file).
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60  # docstrings aside

CLI_PACKAGES = {"cli", "launcher", "demo"}
CLIENT_DEPENDENCIES = {"grpc", "grpc_health", "google", "numpy", "torch", "fastexp", "safetensors",
                       "stamina",  # resuming broken streams' backoff (fastexp/resume.py; pure Python, with tenacity)
                       "av",  # the optional `video` extra (fastexp/video.py imports it when a video file is given)
                       "trl", "peft"}  # the optional `trl` extra (fastexp/integrations/trl imports them when used)
MATH_DEPENDENCIES = {"torch", "numpy"}
WIRE = ("grpc", "google.protobuf", "fastexp.v1")
#: Experience-service package -> the experience packages it may import (at run time, transitively bounded below).
EXPERIENCE_ALLOWED = {
    "config": {"config"},
    "workers": {"config", "workers"},
    "pipeline": {"config", "workers", "pipeline"},
    "fleet": {"config", "fleet", "pipeline.events"},
    "api": {"config", "workers", "pipeline", "fleet", "runs", "state", "api"},
    "gateway": {"config", "pipeline", "gateway"},  # the OpenAI-compatible edge over the Generator protocol
    "runs": {"runs", "state"},  # the runs' records, their owner and the operator's limits on them
    "state": {"state"},  # the durable, shared state: the store, its rows and migrations, the versions' ledger
    "settings": {"fleet", "runs", "settings"},
    "server": {"config", "workers", "pipeline", "fleet", "api", "gateway", "runs", "state", "settings", "server"},
}
#: Packages whose whole import closure is free of gRPC and generated protobuf classes.
WIRE_FREE = ("fastexp.rl", "services.experience.config", "services.experience.pipeline", "services.experience.workers",
             "services.experience.gateway", "services.experience.runs", "services.experience.state",
             "services.common.identity")
#: Other cores (engines, reward sources, sandboxes): no gRPC or generated classes in their own imports.
CORES = [
    "services/scorer/environments.py", "services/scorer/builtin_environments.py",
    "services/scorer/sandbox/base.py", "services/scorer/sandbox/bubblewrap.py", "services/scorer/sandbox/remote.py",
    "services/scorer/sandbox/gvisor.py", "services/scorer/sandbox/supervise.py", "services/scorer/sandbox/cgroup.py",
    "services/scorer/sandbox/gvisor_usage.py", "services/scorer/sandbox/cgroup_v2.py",
    "services/scorer/sandbox/run_groups.py",
    "services/scorer/tool_calls.py", "services/generator/engine.py",
    "services/generator/hf_engine.py", "services/generator/vllm_engine.py", "services/scorer/scorer.py",
    "services/scorer/composition.py", "services/scorer/rules.py", "services/scorer/models.py",
    "services/scorer/remote.py", "services/common/generation.py", "services/common/errors.py",
    "services/common/metrics.py", "services/common/deadlines.py", "services/common/media.py",
]


def _module_name(path: Path) -> str:
    relative = path.relative_to(ROOT)
    if relative.parts[0] == "client":
        relative = relative.relative_to("client")
    return ".".join(relative.with_suffix("").parts).removesuffix(".__init__")


@cache
def _modules() -> dict[str, Path]:
    """Every module of both distributions (generated code aside), by dotted name."""
    paths = [*(ROOT / "services").rglob("*.py"), *(ROOT / "client" / "fastexp").rglob("*.py")]
    return {_module_name(path): path for path in sorted(paths) if "v1" not in path.relative_to(ROOT).parts}


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


@cache
def _imports(module: str) -> frozenset[str]:
    """The modules ``module`` imports at run time, at any depth (function-level imports included)."""
    names: set[str] = set()
    pending = [ast.parse(_modules()[module].read_text())]
    while pending:
        for node in ast.iter_child_nodes(pending.pop()):
            if _is_type_checking(node):
                continue
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names
                             if f"{node.module}.{alias.name}" in _modules())
            pending.append(node)
    return frozenset(names)


@cache
def _closure(module: str) -> frozenset[str]:
    """Everything importing ``module`` loads: its imports and, for fastexp's own modules, theirs."""
    seen, pending = set(), [module]
    while pending:
        for imported in _imports(pending.pop()):
            if imported not in seen:
                seen.add(imported)
                if imported in _modules():
                    pending.append(imported)
    return frozenset(seen)


def _layer(module: str) -> int | None:
    """0 client package, 1 services.common, 2 a service, 3 command line; None: not fastexp's."""
    parts = module.split(".")
    if parts[0] == "fastexp":
        return 0
    if parts[0] == "services":
        if len(parts) > 1 and parts[1] in CLI_PACKAGES:
            return 3
        return 1 if len(parts) > 1 and parts[1] == "common" else 2
    return None


def _experience_package(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["services", "experience"] or len(parts) < 3:
        return None
    return "pipeline.events" if parts[2:4] == ["pipeline", "events"] else parts[2]


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def test_modules_and_functions_stay_small():
    too_long = []
    for module, path in _modules().items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{module}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if ast.get_docstring(node, clean=False) is not None:
                    length -= node.body[0].end_lineno - node.body[0].lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{module}.{node.name}: {length} lines")
    assert not too_long, too_long


def test_no_module_imports_a_higher_layer_or_another_service():
    wrong = []
    for module in _modules():
        layer = _layer(module)
        for imported in _imports(module):
            other = _layer(imported)
            if other is None:
                top = imported.split(".")[0]
                if layer == 0 and top not in CLIENT_DEPENDENCIES and top not in sys.stdlib_module_names:
                    wrong.append(f"{module} imports {imported} (the client installs light)")
            elif other > layer:
                wrong.append(f"{module} (layer {layer}) imports {imported} (layer {other})")
            elif layer == other == 2 and imported.split(".")[1] != module.split(".")[1]:
                wrong.append(f"{module} imports another service: {imported}")
    assert not wrong, wrong


def test_the_rl_math_needs_only_torch_and_numpy():
    wrong = [
        f"{module} loads {imported}"
        for module in _modules() if _under(module, ("fastexp.rl",))
        for imported in _closure(module)
        if not (_under(imported, ("fastexp",)) and not _under(imported, ("fastexp.v1",)))
        and imported.split(".")[0] not in MATH_DEPENDENCIES | set(sys.stdlib_module_names)
    ]
    assert not wrong, wrong


def test_the_experience_packages_import_only_what_their_role_allows():
    wrong = []
    for module in _modules():
        package = _experience_package(module)
        if package is None:
            continue
        allowed = EXPERIENCE_ALLOWED["pipeline" if package == "pipeline.events" else package]
        for imported in _imports(module):
            other = _experience_package(imported)
            if other is not None and other not in allowed and not (other == "pipeline.events" and "pipeline" in allowed):
                wrong.append(f"{module} ({package}) imports {imported} ({other})")
    assert not wrong, wrong


def test_cores_take_domain_types_not_grpc_or_generated_classes():
    wrong = [
        f"{module} loads {imported}"
        for module in _modules() if _under(module, WIRE_FREE)
        for imported in _closure(module) if _under(imported, WIRE)
    ]
    wrong += [f"{path} imports {imported}" for path in CORES
              for imported in _imports(_module_name(ROOT / path)) if _under(imported, WIRE)]
    assert not wrong, wrong


#: The weights package's modules in import order: each may import only those before it (no cycle, one direction).
WEIGHTS_ORDER = ("records", "checks", "staging", "blobs", "wire")


def test_the_weights_path_imports_one_way_and_only_its_wire_knows_protobuf():
    package = "services.common.weights"
    wrong = []
    for rank, name in enumerate(WEIGHTS_ORDER):
        module = f"{package}.{name}"
        for imported in _imports(module):
            if _under(imported, (package,)) and imported != package:
                other = imported.removeprefix(package + ".").split(".")[0]
                if other not in WEIGHTS_ORDER[:rank]:
                    wrong.append(f"{module} imports {imported}")
            if name != "wire" and _under(imported, WIRE):
                wrong.append(f"{module} imports {imported} (only wire may)")
        if package in _imports(module):
            wrong.append(f"{module} imports the package itself (a cycle through __init__)")
    assert not wrong, wrong
    assert not [m for m in _closure(package) if _under(m, WIRE)], "services.common.weights loads protobuf"


def test_no_module_bounds_an_await_with_asyncio_wait_for():
    """``asyncio.wait_for`` on Python 3.11 swallows a cancel that lands while the awaited result is on its way
    (it returns the result instead; gh-86296, reimplemented on ``asyncio.timeout`` in 3.12): a loop that polls
    through it, cancelled as a service stops, runs on for ever, and its ``close()`` waits for it for ever (a drained
    experience replica that never exited, CI of 2026-11-25). ``async with asyncio.timeout(s)`` lets it through."""
    found = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "wait_for" and isinstance(node.value, ast.Name) \
                    and node.value.id == "asyncio":
                found.append(f"{module}:{node.lineno}")
    assert not found, found


def test_asyncio_wait_for_still_swallows_a_cancel_on_this_python():
    """The reason for the rule above, checked on the running interpreter: once this fails (a Python whose
    wait_for lets the cancel through), the rule may go."""
    import asyncio

    async def poll() -> str:
        loop = asyncio.get_running_loop()
        for _ in range(3):
            result = loop.create_future()

            def arrive(result=result) -> None:
                result.set_result(None)
                loop.call_soon(task.cancel)  # the cancel lands while the result is on its way

            loop.call_soon(arrive)
            await asyncio.wait_for(result, 10)
        return "ran on"

    async def main() -> str:
        nonlocal task
        task = asyncio.ensure_future(poll())
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"

    task = None
    outcome = asyncio.run(main())
    assert outcome == "ran on", "this Python's wait_for lets the cancel through: the rule above may go"
