"""The code's boundaries, checked on its source: module and function sizes, and which layer may import which.

Layers, bottom up: the client package (``fastexp`` minus its command-line modules: the contract, records, wire
codec, SDK), ``services/common``, the three services (none imports another), and the command line on top
(``fastexp.cli``, ``launcher``, ``demo``, ...). The client package needs only grpcio, protobuf, numpy and torch.
Cores (the pipeline's stages, the math, the engines and reward sources) import neither gRPC nor generated
protobuf classes: servicers and clients translate at the edge.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60  # docstrings aside

CLI_MODULES = {"cli", "launcher", "demo", "demo_plot", "datasets", "torchvision_cpu"}
CLIENT_DEPENDENCIES = {"grpc", "grpc_health", "google", "numpy", "torch", "fastexp", "safetensors",
                       "av",  # the optional `video` extra (fastexp/video.py imports it when a video file is given)
                       "trl", "peft"}  # the optional `trl` extra (fastexp/integrations/trl imports them when used)
CORES = [
    "services/experience/pipeline.py", "services/experience/producer.py", "services/experience/forwarder.py",
    "services/experience/batcher.py", "services/experience/weight_sync.py", "services/experience/events.py",
    "services/experience/estimate.py", "services/experience/advantages.py", "services/experience/kl.py",
    "services/experience/rewards.py", "services/experience/processing.py", "services/experience/upstream.py",
    "services/experience/policy.py", "services/experience/runs.py", "services/experience/fleet.py",
    "services/experience/replicas.py", "services/experience/routing.py", "services/experience/episodes.py",
    "services/scorer/environments.py", "services/scorer/builtin_environments.py",
    "services/scorer/sandbox/base.py", "services/scorer/sandbox/bubblewrap.py", "services/scorer/sandbox/remote.py",
    "services/scorer/tool_calls.py", "services/generator/engine.py",
    "services/generator/hf_engine.py", "services/generator/vllm_engine.py", "services/scorer/scorer.py",
    "services/scorer/composition.py", "services/scorer/rules.py", "services/scorer/models.py",
    "services/scorer/remote.py", "services/common/generation.py", "services/common/errors.py",
    "services/common/metrics.py", "services/common/deadlines.py", "services/common/media.py",
]


def _sources() -> list[Path]:
    return sorted(
        path for folder in ("services", "fastexp") for path in (ROOT / folder).rglob("*.py") if "v1" not in path.parts
    )


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _layer(module: str) -> int | None:
    """0 client package, 1 services.common, 2 a service, 3 command line; None: not fastexp's."""
    parts = module.split(".")
    if parts[0] == "fastexp":
        return 3 if len(parts) > 1 and parts[1] in CLI_MODULES else 0
    if parts[0] == "services":
        return 1 if len(parts) > 1 and parts[1] == "common" else 2
    return None


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_and_functions_stay_small(path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if ast.get_docstring(node, clean=False) is not None:
                length -= node.body[0].end_lineno - node.body[0].lineno + 1
            assert length <= MAX_FUNCTION_LINES, f"{node.name}: {length} lines"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_higher_layer_or_another_service(path):
    module = _module_name(path)
    layer = _layer(module)
    for imported in _imports(path):
        other = _layer(imported)
        if other is None:
            if layer == 0:  # the client package installs light
                top = imported.split(".")[0]
                assert top in CLIENT_DEPENDENCIES or top in sys.stdlib_module_names, f"{module} imports {imported}"
            continue
        assert other <= layer, f"{module} (layer {layer}) imports {imported} (layer {other})"
        if layer == other == 2:
            assert imported.split(".")[1] == module.split(".")[1], f"{module} imports another service: {imported}"


@pytest.mark.parametrize("path", CORES)
def test_cores_take_domain_types_not_grpc_or_generated_classes(path):
    for imported in _imports(ROOT / path):
        assert not imported.startswith(("grpc", "fastexp.v1")), f"{path} imports {imported}"
