"""``kvcanary.ops``: the stable public path of the kernel wrappers.

The wrappers live one kernel a module in ``kvcanary.kernels`` (``write``, ``verify``, ``plan_step``, ``check``,
``tokens``, ``row_serials``, and ``call`` for what they share); this module re-exports their public names
(``__all__``) so that ``from kvcanary.ops import canary_write_step`` keeps working whatever the package's inner layout.
"""

from __future__ import annotations

from kvcanary.kernels.call import RealKvLaunch, load_module, prepare_real_kv, real_kv_launch_args
from kvcanary.kernels.check import CheckLaunch, canary_check_step
from kvcanary.kernels.plan_step import canary_plan_step
from kvcanary.kernels.row_serials import canary_row_serial_update
from kvcanary.kernels.tokens import canary_token_update
from kvcanary.kernels.verify import canary_verify_step
from kvcanary.kernels.write import WriteLaunch, canary_write_step

__all__ = [
    "CheckLaunch", "RealKvLaunch", "WriteLaunch", "canary_check_step", "canary_plan_step", "canary_token_update",
    "canary_verify_step", "canary_write_step", "load_module", "prepare_real_kv", "real_kv_launch_args",
    "canary_row_serial_update",
]
