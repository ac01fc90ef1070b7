"""engines/ runs on Ray workers: it must import neither Prefect nor MLflow, directly or transitively."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("prefect", "mlflow", "flows", "tasks")


def test_no_forbidden_import_statements_in_engines():
    offenders = []
    for path in (ROOT / "engines").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []


def test_importing_every_engine_module_loads_neither_prefect_nor_mlflow():
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "engines").rglob("*.py")
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'prefect', 'mlflow'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_flows_do_no_tensor_work_and_fetch_no_batches():
    """The flow is the recipe: tensors live in engines and move between actors; flows/ neither imports
    torch nor fetches or stores objects with Ray (ray.get / ray.put / ray.wait happen inside tasks)."""
    offenders = []
    for path in (ROOT / "flows").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                offenders += [f"{path.relative_to(ROOT)}: import {n}" for n in names if n.split(".")[0] == "torch"]
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ray"
                    and node.attr in ("get", "put", "wait")):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: ray.{node.attr}")
    assert offenders == []
