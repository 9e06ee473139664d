"""A test-only sglang plugin written into a run folder: the driver's way into every sglang process (the scheduler
runs in its own), never part of kvcanary.

sglang loads the ``sglang.srt.plugins`` entry points it finds on ``sys.path`` in each of its processes; a folder
with a module and a ``.dist-info`` is such a distribution once it is on ``PYTHONPATH``. The plugin's ``register()``
does nothing unless ``gate_env`` is set (non-empty, not ``0``); then it loads the file ``$file_env`` names as a
module (once per process) and calls its ``function`` with the gate's value.
"""

from __future__ import annotations

import os


def write_test_plugin(root: str, plugin: str, *, about: str, gate_env: str, file_env: str, module: str,
                      function: str) -> str:
    """Write the plugin ``plugin`` into ``root`` (see the module docstring); ``about`` ends its docstring.
    Returns ``root``."""
    dist = os.path.join(root, f"{plugin}-0.0.0.dist-info")
    os.makedirs(dist, exist_ok=True)
    with open(os.path.join(dist, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {plugin}\nVersion: 0.0.0\n")
    with open(os.path.join(dist, "entry_points.txt"), "w") as f:
        f.write(f"[sglang.srt.plugins]\n{plugin} = {plugin}:register\n")
    with open(os.path.join(root, f"{plugin}.py"), "w") as f:
        f.write(f'''"""Test-only sglang plugin ({about}); never part of kvcanary."""
import importlib.util
import os
import sys


def register():
    value = os.environ.get("{gate_env}", "")
    if not value or value == "0":
        return
    mod = sys.modules.get("{module}")
    if mod is None:
        spec = importlib.util.spec_from_file_location("{module}", os.environ["{file_env}"])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["{module}"] = mod
        spec.loader.exec_module(mod)
    mod.{function}(value)
''')
    return root


def with_test_plugin(env: dict, root: str, plugin: str, *, about: str, gate_env: str, file_env: str, module: str,
                     function: str, driver_file: str) -> dict:
    """:func:`write_test_plugin` at ``root``, then :func:`plugin_env`: a worker environment that loads it, calling
    ``function`` of ``driver_file``."""
    write_test_plugin(root, plugin, about=about, gate_env=gate_env, file_env=file_env, module=module,
                      function=function)
    return plugin_env(env, root, plugin, file_env=file_env, driver_file=driver_file)


def plugin_env(env: dict, root: str, plugin: str, *, file_env: str, driver_file: str) -> dict:
    """A copy of ``env`` that loads the plugin written at ``root``: ``root`` first on PYTHONPATH, ``file_env``
    naming ``driver_file`` (the file whose function the plugin calls), and the plugin added to SGLANG_PLUGINS when
    the caller restricts sglang's plugins to a list."""
    env = dict(env)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env[file_env] = os.path.abspath(driver_file)
    if env.get("SGLANG_PLUGINS"):
        env["SGLANG_PLUGINS"] += f",{plugin}"
    return env
