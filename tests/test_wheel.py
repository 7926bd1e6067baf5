"""The wheel works without the repository: `pip wheel .` ships every file the
packages read at run time, and the quantizer runs from a non-editable install.

Guards the failure where the wheel lacked `refit/quantizer/_fused_cpu.c`, so an
installed refit raised at the first quantization while every test of the
editable install passed. No Ray, no vLLM: the fast tier.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("refit", "actors")
# Whatever the calling shell points Python at would hide what the wheel lacks.
ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}

QUANTIZE = """
import sys
from pathlib import Path

import torch

import refit
from refit.quantizer import _fused_cpu
from refit.quantizer.fp8_block import _quantize_with_torch

assert Path(refit.__file__).is_relative_to(sys.prefix), f"not the installed copy: {refit.__file__}"
w = (torch.randn(300, 200, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16)
q, scale = refit.quantize_fp8_block(w, name="w")
assert _fused_cpu.handles(w), "the fused kernel was not built from the installed C source"
ref_q, ref_scale = _quantize_with_torch(w, (128, 128))
assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), "FP8 codes differ from the torch path"
assert torch.equal(scale.view(torch.int16), ref_scale.view(torch.int16)), "scales differ from the torch path"
"""


def run(args: list[str | Path], *, cwd: Path, timeout: float = 120) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{str(args[:3])[:200]}:\n{result.stdout[-3000:]}{result.stderr[-5000:]}"
    return result.stdout


def git_files(*paths: str) -> list[str]:
    """Tracked and not-yet-added (but not ignored) files: what a commit of this tree would hold."""
    out = run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", *paths], cwd=REPO)
    return sorted({name for name in out.split("\0") if name and (REPO / name).is_file()})


def is_test_or_cache(name: str) -> bool:
    parts = Path(name).parts
    return "__pycache__" in parts or "tests" in parts or parts[-1].startswith("test_") or parts[-1] == "conftest.py"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of a clean copy of the tree: building in the checkout would reuse a
    stale `build/lib` (which can hold files the configuration no longer ships) and
    write into the repository while other tests read it."""
    source = tmp_path_factory.mktemp("source")
    for name in git_files():
        if "/" not in name or name.startswith(tuple(p + "/" for p in PACKAGES)):  # build config + packages
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", dist],
        cwd=source)
    (built,) = dist.glob("refit-*.whl")
    return built


def test_wheel_ships_every_package_file_and_entry_point(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (dist_info,) = {n.split("/")[0] for n in names if ".dist-info/" in n}
        declared = importlib.metadata.PathDistribution(zipfile.Path(z, f"{dist_info}/")).entry_points

    expected = {name for name in git_files(*PACKAGES) if not is_test_or_cache(name)}
    assert {"refit/quantizer/_fused_cpu.c", "refit/py.typed"} <= expected  # the files this test exists for
    shipped = {n for n in names if ".dist-info/" not in n}
    assert shipped == expected, f"missing: {sorted(expected - shipped)}, unexpected: {sorted(shipped - expected)}"

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {"console_scripts": project["scripts"], **project["entry-points"]}
    assert wanted["console_scripts"]["refit"] == "refit.cli:main"
    assert wanted["vllm.general_plugins"], "vLLM plugins register the CPU kernels in every engine process"
    for group, points in wanted.items():
        assert {ep.name: ep.value for ep in declared.select(group=group)} == points, group
        for target in points.values():  # each target's module is in the wheel
            module = target.split(":")[0].replace(".", "/")
            assert f"{module}.py" in shipped or f"{module}/__init__.py" in shipped, target


def test_quantizer_runs_from_an_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path)
    python = venv / "bin" / "python"
    # Reuse this venv's packages (torch, pip, ...) through a .pth line: a directory
    # added that way has its own .pth files ignored, so refit's editable-install
    # finder does not run, which the first check below confirms.
    ours = {sysconfig.get_path(key) for key in ("purelib", "platlib")}
    site_packages = Path(sysconfig.get_path("purelib", "venv", vars={"base": str(venv), "platbase": str(venv)}))
    (site_packages / "main-venv.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    work = tmp_path / "work"  # not the repository, whose refit/ the cwd entry of sys.path would find
    work.mkdir()

    found = "import importlib.util as u; print(u.find_spec('torch') is not None, u.find_spec('refit') is not None)"
    assert run([python, "-c", found], cwd=work).split() == ["True", "False"]

    run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], cwd=work)
    run([python, "-c", QUANTIZE], cwd=work)
