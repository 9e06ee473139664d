"""``kvcanary.ops``: the stable public path of the kernel wrappers.

The wrappers live in ``kvcanary.kernels.ops``; this module re-exports its public names (``__all__``) so that
``from kvcanary.ops import canary_write_step`` keeps working whatever the package's inner layout.
"""

from __future__ import annotations

from kvcanary.kernels.ops import (
    CheckLaunch,
    RealKvLaunch,
    WriteLaunch,
    canary_check_step,
    canary_plan_step,
    canary_row_serial_update,
    canary_token_update,
    canary_verify_step,
    canary_write_step,
    load_module,
    prepare_real_kv,
    real_kv_launch_args,
)

__all__ = [
    "CheckLaunch", "RealKvLaunch", "WriteLaunch", "canary_check_step", "canary_plan_step", "canary_token_update",
    "canary_verify_step", "canary_write_step", "load_module", "prepare_real_kv", "real_kv_launch_args",
    "canary_row_serial_update",
]
