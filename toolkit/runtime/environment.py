"""What is this peer running on? One documented detection chain, and the TPU glue it implies.

The chain, first match wins (DESIGN.md s8):

1. **TPU** through torch_xla's PJRT runtime -- only if ``torch_xla`` is installed, only if its
   version is the same minor as torch's (torch_xla is built against one torch; a mismatched pair
   fails to import or crashes), and only if PJRT reports a ``TPU`` device. torch_xla is imported
   lazily, inside :func:`detect`; a machine without it never imports it.
2. **CUDA** (also ROCm builds, which speak the CUDA API): name, memory, compute capability.
3. **MPS** (Apple GPUs).
4. **CPU**.

Anything that made the chain skip a faster device (a broken torch_xla, say) is logged once per
detection and kept in :attr:`DeviceInfo.hints`, so the notebook panel and the relay can show it.

The result is cached because probing CUDA/XLA is slow and must not happen every step; the cache
is an ordinary ``functools.cache`` that ``detect(refresh=True)`` clears, so re-running a
notebook cell (or a test) gets a fresh answer when it asks for one.

Training-step glue for XLA, all no-ops elsewhere: :func:`device`, :func:`mark_step` (cut the
lazy graph once per micro-batch) and :func:`optimizer_step` (``xm.optimizer_step`` on TPU).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import platform as _platform
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

log = logging.getLogger(__name__)

DeviceKind = Literal["cuda", "tpu", "mps", "cpu"]

TPU_PAIR_HINT = (
    "On Colab/Kaggle TPU runtimes keep the preinstalled torch/torch_xla pair: do not "
    "pip install torch (or anything that upgrades it). Elsewhere install a matching pair, "
    "e.g. pip install 'torch~={minor}.0' 'torch_xla[tpu]~={minor}.0'."
)


@dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    """A typed description of the accelerator; the peer sends :meth:`to_json` to the relay at join."""

    kind: DeviceKind
    name: str
    """Human name: "Tesla T4", "TPU v3", "Apple MPS", the CPU model."""
    memory_bytes: int | None
    """Accelerator memory (host RAM for ``cpu``); None where the runtime does not say."""
    compute_capability: tuple[int, int] | None = None
    """CUDA only: (major, minor), e.g. (7, 5) for a T4. Drives the precision policy."""
    device_count: int = 1
    torch_version: str = ""
    torch_xla_version: str | None = None
    platform: str | None = None
    """"colab", "kaggle" or None: decides which fix a hint should name."""
    hints: tuple[str, ...] = field(default=())
    """Why a faster device was skipped, with the fix (empty when nothing went wrong)."""

    @property
    def label(self) -> str:
        """One line for logs and the notebook panel, e.g. "Tesla T4 (cuda, 15.0 GiB)"."""
        mem = f", {self.memory_bytes / 2**30:.1f} GiB" if self.memory_bytes else ""
        return f"{self.name} ({self.kind}{mem})"

    def to_json(self) -> dict[str, Any]:
        """A plain JSON-able dict (tuples become lists)."""
        data = asdict(self)
        data["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        data["hints"] = list(self.hints)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "DeviceInfo":
        """The inverse of :meth:`to_json` (the relay and recorded test fixtures use it)."""
        values = dict(data)
        cc = values.get("compute_capability")
        values["compute_capability"] = (int(cc[0]), int(cc[1])) if cc else None
        values["hints"] = tuple(values.get("hints") or ())
        return cls(**values)


def detect(*, refresh: bool = False) -> DeviceInfo:
    """The accelerator this process should train on (cached; ``refresh=True`` probes again)."""
    if refresh:
        _detect.cache_clear()
    return _detect()


@functools.cache
def _detect() -> DeviceInfo:
    hints: list[str] = []
    base: dict[str, Any] = {"torch_version": torch.__version__, "platform": notebook_platform()}
    tpu = _probe_tpu(hints)
    if tpu is not None:
        return DeviceInfo(**tpu, **base, hints=tuple(hints))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return DeviceInfo(
            kind="cuda",
            name=props.name,
            memory_bytes=int(props.total_memory),
            compute_capability=(int(props.major), int(props.minor)),
            device_count=torch.cuda.device_count(),
            **base,
            hints=tuple(hints),
        )
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        recommended = getattr(torch.mps, "recommended_max_memory", None)
        return DeviceInfo(
            kind="mps", name="Apple MPS", memory_bytes=_call_or_none(recommended), **base, hints=tuple(hints)
        )
    return DeviceInfo(
        kind="cpu",
        name=_cpu_name(),
        memory_bytes=_host_memory(),
        device_count=os.cpu_count() or 1,
        **base,
        hints=tuple(hints),
    )


def notebook_platform() -> str | None:
    """ "colab", "kaggle" or None, from the environment variables those runtimes set."""
    if "COLAB_RELEASE_TAG" in os.environ or "COLAB_GPU" in os.environ or "COLAB_TPU_ADDR" in os.environ:
        return "colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in os.environ or "KAGGLE_URL_BASE" in os.environ:
        return "kaggle"
    return None


# --- TPU ------------------------------------------------------------------------------------
def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _minor(version: str) -> tuple[int, ...]:
    parts = version.split("+")[0].split(".")[:2]
    return tuple(int(p) for p in parts if p.isdigit())


def _warn(hints: list[str], message: str) -> None:
    log.warning("%s", message)
    hints.append(message)


def _probe_tpu(hints: list[str]) -> dict[str, Any] | None:
    """TPU fields for :class:`DeviceInfo`, or None (recording in ``hints`` why, if it matters)."""
    if importlib.util.find_spec("torch_xla") is None:
        return None
    xla_version = _dist_version("torch_xla") or "unknown"
    torch_minor = ".".join(map(str, _minor(torch.__version__)))
    if xla_version != "unknown" and _minor(xla_version) != _minor(torch.__version__):
        _warn(
            hints,
            f"torch_xla {xla_version} cannot run with torch {torch.__version__} (each torch_xla "
            f"needs the torch of its own minor version); not using the TPU. "
            + TPU_PAIR_HINT.format(minor=torch_minor),
        )
        return None
    try:
        xla = importlib.import_module("torch_xla")
        xm = importlib.import_module("torch_xla.core.xla_model")
        xr = importlib.import_module("torch_xla.runtime")
    except Exception as exc:  # ImportError, OSError (undefined symbol), RuntimeError: all mean "unusable"
        _warn(
            hints,
            f"torch_xla {xla_version} is installed but failed to import ({type(exc).__name__}: "
            f"{exc}); not using the TPU. " + TPU_PAIR_HINT.format(minor=torch_minor),
        )
        return None
    try:
        kind = xr.device_type()  # importing torch_xla picked it: TPU when libtpu finds chips, else CPU/CUDA
        if kind != "TPU":
            log.info("torch_xla is installed but its PJRT device is %r, not TPU: not using XLA", kind)
            return None
        dev = _xla_device(xla, xm)
    except Exception as exc:  # e.g. the TPU is held by another process (a second notebook kernel)
        _warn(
            hints,
            f"torch_xla could not open the TPU ({type(exc).__name__}: {exc}); not using it. If another "
            "process holds the TPU, stop it (restart the runtime) and run this cell again.",
        )
        return None
    count = (
        _call_or_none(getattr(xr, "global_runtime_device_count", None))
        or _call_or_none(getattr(xr, "addressable_device_count", None))
        or 1
    )
    accel = os.environ.get("TPU_ACCELERATOR_TYPE")  # e.g. "v5litepod-8" on TPU VMs
    return {
        "kind": "tpu",
        "name": f"TPU {accel}" if accel else "TPU",
        "memory_bytes": _xla_memory(xm, dev),
        "device_count": int(count),
        "torch_xla_version": getattr(xla, "__version__", xla_version),
    }


def _xla_device(xla: Any, xm: Any) -> torch.device:
    # torch_xla >= 2.4 has torch_xla.device(); xm.xla_device() is deprecated there but is the only
    # spelling older releases (Colab's long-lived images) have.
    return xla.device() if hasattr(xla, "device") else xm.xla_device()


def _xla_memory(xm: Any, dev: torch.device) -> int | None:
    try:
        info = xm.get_memory_info(dev)
    except Exception:  # not every PJRT plugin implements it
        return None
    if "bytes_limit" in info:  # torch_xla >= 2.5
        return int(info["bytes_limit"])
    if "kb_total" in info:  # older releases
        return int(info["kb_total"]) * 1024
    return None


def _xla_modules() -> tuple[Any, Any]:
    """(torch_xla, torch_xla.core.xla_model); only called once detection said TPU."""
    return importlib.import_module("torch_xla"), importlib.import_module("torch_xla.core.xla_model")


# --- training-step glue ---------------------------------------------------------------------
def device(info: DeviceInfo | None = None) -> torch.device:
    """The torch device to put the model and batches on (an XLA device on TPU)."""
    info = info or detect()
    if info.kind == "tpu":
        return _xla_device(*_xla_modules())
    return torch.device({"cuda": "cuda", "mps": "mps"}.get(info.kind, "cpu"))


def mark_step(info: DeviceInfo | None = None) -> None:
    """Cut and run the lazily traced XLA graph (once per micro-batch); a no-op off TPU.

    Without it a TPU peer would keep extending one graph forever: nothing executes and memory
    grows. Call it after the optimizer step if you did not use :func:`optimizer_step`.
    """
    info = info or detect()
    if info.kind != "tpu":
        return
    xla, xm = _xla_modules()
    (xla.sync if hasattr(xla, "sync") else xm.mark_step)()  # torch_xla >= 2.4 spells it sync()


def optimizer_step(optimizer: torch.optim.Optimizer, info: DeviceInfo | None = None, **step_kwargs: Any) -> Any:
    """``optimizer.step(**step_kwargs)``, the way the device needs it.

    On TPU this is ``xm.optimizer_step(optimizer, barrier=True, optimizer_args=step_kwargs)``:
    it all-reduces gradients across the process's replicas (a no-op with one) and, with the
    barrier, marks the step so the graph executes. Elsewhere it is a plain ``step``.
    """
    info = info or detect()
    if info.kind != "tpu":
        return optimizer.step(**step_kwargs)
    _, xm = _xla_modules()
    return xm.optimizer_step(optimizer, barrier=True, optimizer_args=step_kwargs)


# --- small probes ---------------------------------------------------------------------------
def _call_or_none(fn: Any) -> Any:
    if fn is None:
        return None
    try:
        return fn()
    except Exception:  # a probe that fails means "unknown", never a crash at join
        return None


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX (Windows)
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine() or "cpu"
