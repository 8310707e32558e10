"""What a result depends on besides the kernel: the device and the toolchain."""
from __future__ import annotations

import hashlib
import json
import platform

from autotile.device import DeviceInfo


def device_fingerprint(device: DeviceInfo) -> tuple[str, dict]:
    fields = device.fingerprint()
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]
    return digest, fields


def toolchain_versions() -> dict[str, str]:
    import torch
    import triton

    import autotile

    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
        "autotile": autotile.__version__,
    }
