"""integration/loop_probe.py's patches of sglang 0.5.12's classes (the driver's --loop-probe), on CPU: in a
subprocess, because they are global (the other probe tests are in tests/integration/test_loop_probe.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PROBE = HERE.parents[1] / "integration" / "loop_probe.py"


def _sglang_version() -> str:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return ""


@pytest.mark.skipif(not _sglang_version().startswith("0.5.12"), reason="the probe patches sglang 0.5.12's loop")
def test_install_patches_sglang_classes_once() -> None:
    code = f"""
import importlib.util, sys, torch
sys.path.insert(0, {str(HERE)!r})
import _sglang_cpu_shims; _sglang_cpu_shims.apply()
spec = importlib.util.spec_from_file_location("lp", {str(PROBE)!r})
lp = importlib.util.module_from_spec(spec); spec.loader.exec_module(lp)
import os, tempfile
env = lp.probe_env({{}}, tempfile.mkdtemp())  # the plugin, as the driver writes it
os.environ.update({{k: v for k, v in env.items() if k != "PYTHONPATH"}})
sys.path.insert(0, env["PYTHONPATH"])
import kvcanary_e2e_loop_probe as plugin
plugin.register()  # loads loop_probe.py as a module of its own and installs
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tp_worker import TpModelWorker
first = Scheduler.run_batch
assert first.e2e_probe == "run_ns"
lp.install(); plugin.register()  # once per process, whichever module asks
assert Scheduler.run_batch is first and first.e2e_probe == "run_ns"
assert TpModelWorker.forward_batch_generation.e2e_probe == "fbg_ns"
assert Scheduler.process_batch_result.e2e_probe == "result_ns"
assert Scheduler.launch_batch_sample_if_needed.__name__ == "probed_sample"
assert torch.cuda.Event.synchronize.__name__ == "event_synchronize"
from kvcanary.runtime.manager import CanaryManager
from kvcanary.runtime.drain import ViolationDrain
assert CanaryManager.step.e2e_probe == "kvc_step_ns" and ViolationDrain.drain.e2e_probe == "kvc_drain_ns"
assert lp.install_kvcanary_pieces() == 0  # once
import importlib
def timed(module, cls, name):
    owner = importlib.import_module(module)
    owner = owner if cls is None else getattr(owner, cls)  # (None: a function the module calls by name)
    return getattr(owner.__dict__.get(name), "e2e_probe", None)
missing = [p for p in lp.KVCANARY_PIECES + lp.KVCANARY_REPORTED_PIECES if not timed(*p[:3])]
assert not missing, missing  # every piece the probe names exists in this kvcanary
assert Scheduler.process_batch_result_decode.e2e_probe == "tok_after_result_ns"  # (the env's experiment)
print("ok")
"""
    plugin = str(HERE.parents[1] / "plugin")  # this checkout's kvcanary
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", E2E_LOOP_PROBE_TOKENS_AFTER_RESULT="1",
               PYTHONPATH=plugin + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok" in out.stdout
