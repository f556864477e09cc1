"""Device detection: the real chain on this (CPU) machine, and every other branch with recorded
device descriptions or a stand-in ``torch_xla`` package written from torch_xla's documented API."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import logging
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from toolkit.runtime import environment
from toolkit.runtime.environment import DeviceInfo, detect


@pytest.fixture(autouse=True)
def fresh_detection(monkeypatch: pytest.MonkeyPatch):
    """Every test starts and ends with an empty detection cache and no notebook env vars."""
    for var in (
        "COLAB_RELEASE_TAG",
        "COLAB_GPU",
        "COLAB_TPU_ADDR",
        "KAGGLE_KERNEL_RUN_TYPE",
        "KAGGLE_URL_BASE",
        "TPU_ACCELERATOR_TYPE",
    ):
        monkeypatch.delenv(var, raising=False)
    environment._detect.cache_clear()
    yield
    environment._detect.cache_clear()


@pytest.fixture
def forbid_torch_xla(monkeypatch: pytest.MonkeyPatch):
    """Fail the test if anything imports ``torch_xla`` (probing with find_spec is allowed)."""
    import builtins

    real_import_module, real_import = importlib.import_module, builtins.__import__

    def check(name: str) -> None:
        if name == "torch_xla" or name.startswith("torch_xla."):
            raise AssertionError(f"{name} was imported")

    def import_module(name, package=None):
        check(name)
        return real_import_module(name, package)

    def guarded_import(name, *args, **kwargs):
        check(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", import_module)
    monkeypatch.setattr(builtins, "__import__", guarded_import)


class _RecordingOptimizer:
    """Stands in for CollaborativeOptimizer: ``step`` takes keyword arguments."""

    seen: dict | None = None

    def step(self, closure=None, **kwargs):
        self.seen = kwargs


def _only_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def test_this_machine_without_torch_xla_is_cpu_and_never_imports_it(monkeypatch, forbid_torch_xla):
    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("torch_xla is installed here")
    _only_cpu(monkeypatch)
    info = detect(refresh=True)
    assert info.kind == "cpu" and info.device_count >= 1 and info.torch_version == torch.__version__
    assert info.torch_xla_version is None and info.hints == ()
    assert info.memory_bytes is None or info.memory_bytes > 2**20
    assert "torch_xla" not in sys.modules
    assert environment.device(info) == torch.device("cpu")


def test_detect_is_cached_until_refresh(monkeypatch):
    _only_cpu(monkeypatch)
    first = detect()
    assert detect() is first
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    assert detect().platform is None  # cached
    again = detect(refresh=True)
    assert again is not first and again.platform == "kaggle"


@pytest.mark.parametrize(
    "var,expected",
    [("COLAB_RELEASE_TAG", "colab"), ("COLAB_TPU_ADDR", "colab"), ("KAGGLE_KERNEL_RUN_TYPE", "kaggle"), (None, None)],
)
def test_notebook_platform(monkeypatch, var, expected):
    if var:
        monkeypatch.setenv(var, "x")
    assert environment.notebook_platform() == expected


def test_cuda_branch_with_a_recorded_t4(monkeypatch):
    props = SimpleNamespace(name="Tesla T4", total_memory=15_828_320_256, major=7, minor=5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab-20250101")
    info = detect(refresh=True)
    assert (info.kind, info.name, info.compute_capability, info.device_count, info.platform) == (
        "cuda",
        "Tesla T4",
        (7, 5),
        2,
        "colab",
    )
    assert info.memory_bytes == 15_828_320_256
    assert info.label == "Tesla T4 (cuda, 14.7 GiB)"
    assert environment.device(info) == torch.device("cuda")


def test_mps_branch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 12 * 2**30, raising=False)
    info = detect(refresh=True)
    assert (info.kind, info.memory_bytes) == ("mps", 12 * 2**30)
    assert environment.device(info) == torch.device("mps")


def test_to_json_is_plain_json_and_round_trips():
    info = DeviceInfo(
        kind="cuda",
        name="NVIDIA A100-SXM4-40GB",
        memory_bytes=42_298_834_944,
        compute_capability=(8, 0),
        device_count=1,
        torch_version="2.5.1+cu121",
        platform="colab",
        hints=("something",),
    )
    data = json.loads(json.dumps(info.to_json()))
    assert data["compute_capability"] == [8, 0] and data["hints"] == ["something"]
    assert DeviceInfo.from_json(data) == info


# --- TPU: version guard, import failure, and a stand-in torch_xla -------------------------------
def _pretend_torch_xla_installed(monkeypatch, version: str) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "torch_xla":
            return importlib.machinery.ModuleSpec("torch_xla", None)
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(environment.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(environment, "_dist_version", lambda name: version if name == "torch_xla" else None)


def _torch_minor() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def test_mismatched_torch_xla_is_not_imported_and_the_hint_names_the_fix(monkeypatch, forbid_torch_xla, caplog):
    """The case the issue reports: torch_xla 2.9 next to torch 2.13."""
    _only_cpu(monkeypatch)
    _pretend_torch_xla_installed(monkeypatch, "2.9.0")
    with caplog.at_level(logging.WARNING, logger="toolkit.runtime.environment"):
        info = detect(refresh=True)
    assert info.kind == "cpu"
    assert len(info.hints) == 1 and "torch_xla 2.9.0" in info.hints[0]
    assert "do not pip install torch" in info.hints[0]
    assert f"torch~={_torch_minor()}.0" in info.hints[0]
    assert "do not pip install torch" in caplog.text


def _write_fake_torch_xla(root: Path, init: str, *, device_type: str = "return 'TPU'") -> None:
    pkg = root / "torch_xla"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(init))
    (pkg / "core" / "__init__.py").write_text("")
    # The calls toolkit.runtime.environment makes, with torch_xla's documented signatures and results.
    (pkg / "core" / "xla_model.py").write_text(
        textwrap.dedent("""
        import torch
        calls = []
        def xla_device(n=None):
            return torch.device("xla:0")
        def mark_step():
            calls.append("mark_step")
        def get_memory_info(device):
            return {"bytes_used": 1, "bytes_limit": 16 * 2**30}
        def optimizer_step(optimizer, barrier=False, optimizer_args={}, groups=None, pin_layout=True):
            calls.append(("optimizer_step", barrier))
            loss = optimizer.step(**optimizer_args)
            if barrier:
                mark_step()
            return loss
    """)
    )
    (pkg / "runtime.py").write_text(
        textwrap.dedent(f"""
        def device_type():
            {device_type}
        def global_runtime_device_count():
            return 8
    """)
    )


@pytest.fixture
def fake_xla_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m == "torch_xla" or m.startswith("torch_xla.")]:
        del sys.modules[name]


def test_torch_xla_that_fails_to_import_falls_back_with_a_hint(monkeypatch, fake_xla_path):
    _only_cpu(monkeypatch)
    _write_fake_torch_xla(fake_xla_path, "raise ImportError('_XLAC.so: undefined symbol: _ZN3c10')\n")
    monkeypatch.setattr(environment, "_dist_version", lambda name: f"{_torch_minor()}.0")
    info = detect(refresh=True)
    assert info.kind == "cpu"
    assert "failed to import" in info.hints[0] and "undefined symbol" in info.hints[0]
    assert "do not pip install torch" in info.hints[0]


def test_tpu_branch_with_a_stand_in_torch_xla(monkeypatch, fake_xla_path):
    _write_fake_torch_xla(
        fake_xla_path,
        f"""
        import torch
        __version__ = "{_torch_minor()}.0+libtpu"
        calls = []
        def device(index=None):
            return torch.device("xla:0")
        def sync(wait=False):
            calls.append("sync")
    """,
    )
    monkeypatch.setattr(environment, "_dist_version", lambda name: f"{_torch_minor()}.0")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v3-8")
    info = detect(refresh=True)
    assert (info.kind, info.name, info.device_count, info.memory_bytes) == ("tpu", "TPU v3-8", 8, 16 * 2**30)
    assert info.torch_xla_version == f"{_torch_minor()}.0+libtpu"
    assert environment.device(info) == torch.device("xla:0")

    import torch_xla
    import torch_xla.core.xla_model as xm

    environment.mark_step(info)
    assert torch_xla.calls == ["sync"]  # torch_xla >= 2.4 spelling preferred

    opt = _RecordingOptimizer()
    environment.optimizer_step(opt, info, batch_size=8, loss=1.5)
    assert opt.seen == {"batch_size": 8, "loss": 1.5}
    assert xm.calls == [("optimizer_step", True), "mark_step"]


def test_torch_xla_on_a_machine_without_tpu_is_skipped(monkeypatch, fake_xla_path):
    _only_cpu(monkeypatch)
    _write_fake_torch_xla(fake_xla_path, "__version__ = 'x'\n", device_type="return 'CPU'")
    monkeypatch.setattr(environment, "_dist_version", lambda name: f"{_torch_minor()}.0")
    info = detect(refresh=True)
    assert info.kind == "cpu" and info.hints == ()


def test_a_tpu_held_by_another_process_falls_back_with_a_hint(monkeypatch, fake_xla_path):
    _only_cpu(monkeypatch)
    _write_fake_torch_xla(
        fake_xla_path,
        "__version__ = 'x'\n",
        device_type="raise RuntimeError('TPU initialization failed: open(/dev/accel0): busy')",
    )
    monkeypatch.setattr(environment, "_dist_version", lambda name: f"{_torch_minor()}.0")
    info = detect(refresh=True)
    assert info.kind == "cpu" and "could not open the TPU" in info.hints[0] and "restart the runtime" in info.hints[0]


def test_step_glue_is_plain_off_tpu(forbid_torch_xla):
    info = DeviceInfo(kind="cpu", name="cpu", memory_bytes=None)
    environment.mark_step(info)  # no-op, no import

    opt = _RecordingOptimizer()
    environment.optimizer_step(opt, info, batch_size=4)
    assert opt.seen == {"batch_size": 4}
