"""Whether this machine can keep optimizer moments in 8 bits: ``bitsandbytes``' ``AdamW8bit``,
probed on a device by running it.

Both sides ask: a local-SGD peer's inner optimizer (:mod:`toolkit.optimizer.inner`, which falls
back to float32 moments) and the relay's 8-bit master state (:mod:`relay_server.rounds.optim8bit`,
which refuses the run). One probe and one size threshold, so the two cannot disagree about which
tensors are quantized.
"""

from __future__ import annotations

import torch

MIN_8BIT_SIZE = 4096
"""Tensors with fewer values keep float32 moments (bitsandbytes' default, and the relay's)."""


def probe_adamw8bit(device: torch.device) -> type[torch.optim.Optimizer] | str:
    """``bitsandbytes.optim.AdamW8bit`` once one step on a ``device`` tensor worked, or why not:
    probed by running it, not by reading a version number (older releases refuse CPU tensors,
    and a build without kernels for the device imports fine). The relay's 8-bit state asks too
    (:func:`relay_server.rounds.optim8bit.bitsandbytes_cpu`)."""
    try:
        import bitsandbytes
    except Exception as exc:  # ImportError, or a native library that fails to load
        return f"bitsandbytes is not usable here ({type(exc).__name__}: {str(exc)[:160]})"
    try:
        p = torch.nn.Parameter(torch.linspace(-1.0, 1.0, MIN_8BIT_SIZE, device=device))
        p.grad = torch.ones_like(p)
        before = p.detach().clone()
        bitsandbytes.optim.AdamW8bit([p], lr=1e-2, weight_decay=0.0).step()
        if not torch.isfinite(p).all() or torch.equal(p.detach(), before):
            raise RuntimeError("the probe step did not update the parameter")
    except Exception as exc:
        version = getattr(bitsandbytes, "__version__", "?")
        return f"bitsandbytes {version} cannot step on {device.type} ({type(exc).__name__}: {str(exc)[:160]})"
    return bitsandbytes.optim.AdamW8bit
