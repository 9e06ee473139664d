"""Real sglang 0.5.12 ModelRunners on CPU for the MLA and sliding-window configs of integration/models/ (test helper,
no kvcanary logic): the pools, allocators and radix caches sglang builds for them, and two test-only CPU attention
shims where sglang's torch_native backend cannot run the model as shipped.

* ``deepseek-v2-mla-tiny`` (DeepseekV2ForCausalLM, MLA): sglang builds an ``MLATokenToKVPool``. Its attention
  dispatch has no torch_native entry and falls back to triton's, which runs a no-prefix extend as plain MHA
  (``forward_normal``: K/V of 192/128 dims against the pool's 576-dim latents: torch_native's SDPA fails). The
  shim registers torch_native with the absorbed MLA path, the one triton itself takes for every decode and every
  extend with a prefix (and under ``--enable-deterministic-inference``): latent written with ``set_mla_kv_buffer``
  semantics, read back as K (576) and V (the first 512).
* ``gpt-oss-swa-tiny`` (GptOssForCausalLM, 2 sliding + 2 full layers): sglang builds an ``SWAKVPool`` with an
  ``SWATokenToKVPoolAllocator`` and an ``SWARadixCache``. ServerArgs only admits triton/fa3/trtllm_mha/... for
  gpt-oss (built with triton, then switched to torch_native before the runner is built), and torch_native takes
  no ``sinks`` argument and reads a sliding layer's KV with full-pool indices. The shim drops ``sinks`` and, for a
  sliding layer, only writes the KV (``SWAKVPool.set_kv_buffer`` translates the slots through
  ``full_to_swa_index_mapping``, as on the GPU) and returns zeros: kvcanary checks what is written where, not the
  attention output (dummy weights).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

MODELS = Path(__file__).resolve().parents[2] / "integration" / "models"
MLA_MODEL = "deepseek-v2-mla-tiny"
SWA_MODEL = "gpt-oss-swa-tiny"


def model_dir(name: str, dest: Path) -> Path:
    """integration/models/<name> copied to ``dest`` (a config folder: the runner loads dummy weights)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODELS / name / "config.json", dest / "config.json")
    return dest


def config(name: str) -> dict:
    return json.loads((MODELS / name / "config.json").read_text())


def server_args(name: str, dest: Path, **overrides):
    """ServerArgs for ``name`` on CPU (torch_native attention), as tests/adapters/sgl_engine.server_args."""
    import sgl_engine

    path = model_dir(name, dest)
    if name == SWA_MODEL:
        sa = sgl_engine.server_args(path, attention_backend="triton", **overrides)  # gpt-oss's backend check
        sa.attention_backend = "torch_native"
        sa.prefill_attention_backend = sa.decode_attention_backend = None
        return sa
    return sgl_engine.server_args(path, **overrides)


def install_cpu_attention_shims(monkeypatch) -> None:
    """The two test-only shims of the module docstring (undone by ``monkeypatch``)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.models.deepseek_common import attention_backend_handler as h
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    monkeypatch.setitem(h.AttentionBackendRegistry._handlers, "torch_native",
                        lambda attn, forward_batch: AttnForwardMethod.MLA)

    def swa_aware(orig):
        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # sinks: dropped
            pool = forward_batch.token_to_kv_pool
            if isinstance(pool, SWAKVPool) and pool.layers_mapping[layer.layer_id][1]:
                if save_kv_cache:
                    pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
                return q.new_zeros((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
            return orig(self, q, k, v, layer, forward_batch, save_kv_cache)

        return forward

    monkeypatch.setattr(TorchNativeAttnBackend, "forward_extend", swa_aware(TorchNativeAttnBackend.forward_extend))
    monkeypatch.setattr(TorchNativeAttnBackend, "forward_decode", swa_aware(TorchNativeAttnBackend.forward_decode))


def build_tree_cache(mr, sa):
    """The radix cache sglang's Scheduler builds over ``mr``'s pools (an SWARadixCache for a hybrid SWA model),
    through the real (hooked) Scheduler.init_cache_with_memory_pool (sgl_engine.bare_scheduler)."""
    import sgl_engine

    return sgl_engine.bare_scheduler(mr, sa).tree_cache
