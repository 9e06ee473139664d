"""KV pools → groups: one :class:`~kvcanary.runtime.installation.GroupSpec` per shadowed (sub-)pool of an sglang
token-to-KV pool, with the real-KV sources the fingerprint reads (``KVCANARY_REAL_KV_LAYERS``, the adapter's own
variable). The pool classes come from the version module (:class:`PoolClasses`); the buffers they hold
(``k_buffer``/``v_buffer``, ``kv_buffer``, ``full_kv_pool``/``swa_kv_pool``) are read here."""

from __future__ import annotations

import os
import pkgutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.runtime.config import Config
from kvcanary.runtime.installation import GroupSpec
from kvcanary.settings import parse_ascii_int
from kvcanary.sglang.refusal import UnsupportedSetupError

ENV_REAL_KV_LAYERS = "KVCANARY_REAL_KV_LAYERS"
DEFAULT_REAL_KV_LAYERS: tuple[int, ...] = (0, -1)
MAX_REAL_KV_SOURCES = 4


POOL_KINDS = ("mha", "mla", "swa")


@dataclass(frozen=True)
class PoolClasses:
    """Dotted names of one sglang version's KV pool classes (imported only when a pool is converted), and the kinds
    kvcanary has been run with on that version (``followed``): a pool of another kind is refused by name, not
    installed on another version's proof."""

    mha: str
    mla: str
    swa: str
    followed: frozenset[str] = frozenset(POOL_KINDS)


def parse_real_kv_layers(environ: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """``KVCANARY_REAL_KV_LAYERS``: comma-separated layer indices (negative counts from the last layer).

    Default ``0,-1`` (the first and the last layer). Each index is ASCII digits with an optional sign, as every
    ``KVCANARY_*`` integer (``kvcanary.settings.parse_ascii_int``: no ``1_0``, no non-ASCII digits). A bad value
    raises ValueError naming the variable.
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_REAL_KV_LAYERS)
    if raw is None or not raw.strip():
        return DEFAULT_REAL_KV_LAYERS
    layers = []
    for part in raw.split(","):
        try:
            layers.append(parse_ascii_int(part))
        except ValueError:
            raise ValueError(
                f"{ENV_REAL_KV_LAYERS}: expected a comma-separated list of layer indices (negative counts from the "
                f"last layer), e.g. 0,-1; got {raw!r}"
            ) from None
    return tuple(layers)


def resolve_layers(layers: Sequence[int], num_layers: int, per_layer: int, what: str) -> list[int]:
    """Layer indices → distinct local indices in [0, num_layers), in order; at most MAX_REAL_KV_SOURCES sources."""
    out: list[int] = []
    for layer in layers:
        idx = layer + num_layers if layer < 0 else layer
        if not 0 <= idx < num_layers:
            raise ValueError(
                f"{ENV_REAL_KV_LAYERS}: layer {layer} is out of range for {what} with {num_layers} layer(s) "
                f"(valid: 0..{num_layers - 1} or -{num_layers}..-1)"
            )
        if idx not in out:
            out.append(idx)
    if len(out) * per_layer > MAX_REAL_KV_SOURCES:
        raise ValueError(
            f"{ENV_REAL_KV_LAYERS}: {len(out)} layer(s) x {per_layer} buffer(s) per layer of {what} is more than "
            f"{MAX_REAL_KV_SOURCES} real-KV sources; name at most {MAX_REAL_KV_SOURCES // per_layer} layer(s)"
        )
    return out


def token_major_source(buffer: torch.Tensor, num_slots: int, page_size: int) -> RealKvSource:
    """A RealKvSource over one per-layer KV buffer: token-major ``[slots, ...]`` or page-major
    ``[pages, page, ...]``."""
    if buffer.dim() >= 3 and buffer.shape[0] < num_slots and buffer.shape[1] == page_size:
        per_token = buffer[0, 0].numel() * buffer.element_size()
        return RealKvSource(buffer, page_size, per_token, per_token)
    per_token = buffer[0].numel() * buffer.element_size()
    return RealKvSource(buffer, 1, per_token, per_token)


def pool_kind(pool, classes: PoolClasses) -> str:
    """``"swa"``, ``"mla"`` or ``"mha"`` (any other pool too: :func:`pool_groups` then refuses what it cannot read)."""
    if isinstance(pool, pkgutil.resolve_name(classes.swa)):
        return "swa"
    if isinstance(pool, pkgutil.resolve_name(classes.mla)):
        return "mla"
    return "mha"


def pool_groups(pool, config: Config, classes: PoolClasses, sglang_version: str, *,
                sliding_window_size: int | None = None, layers: Sequence[int] | None = None) -> list[GroupSpec]:
    """The KV groups of an sglang token-to-KV pool, with their real-KV sources.

    MHA (incl. subclasses with the same buffers): K and V of the chosen layers; MLA (incl. NSA): the latent
    ``kv_buffer`` of the chosen layers; SWA: a full group over ``full_kv_pool`` and a swa group over
    ``swa_kv_pool`` with ``full_to_swa_index_mapping`` and the window. Anything else: NotImplementedError
    naming the class.
    """
    mha_cls = pkgutil.resolve_name(classes.mha)
    kind = pool_kind(pool, classes)
    if kind not in classes.followed:
        raise UnsupportedSetupError(
            f"kvcanary: the {'sliding-window' if kind == 'swa' else 'MLA'} KV pool {type(pool).__name__} has not "
            f"been run with kvcanary on sglang {sglang_version}: serve this model with an sglang version kvcanary "
            "covers it on (README, Use with SGLang), or unset KVCANARY_MODE"
        )

    layers = parse_real_kv_layers() if layers is None else tuple(layers)
    want_sources = config.real_kv_mode != 0

    def slots_of(p) -> int:
        return int(p.size) + int(p.page_size)

    def mha_sources(p, what: str):
        if not want_sources:
            return ()
        idx = resolve_layers(layers, len(p.k_buffer), 2, what)
        n = slots_of(p)
        out = []
        for i in idx:
            out += [token_major_source(p.k_buffer[i], n, p.page_size),
                    token_major_source(p.v_buffer[i], n, p.page_size)]
        return tuple(out)

    name = type(pool).__name__
    try:
        if kind == "swa":
            full, swa = pool.full_kv_pool, pool.swa_kv_pool
            lut = pool.full_to_swa_index_mapping
            if lut is None:
                raise NotImplementedError(f"kvcanary: {name} has no full_to_swa_index_mapping registered")
            window = int(sliding_window_size or 0)
            if window <= 0:
                raise NotImplementedError(f"kvcanary: {name} without a sliding window size")
            return [
                GroupSpec("full", slots_of(full), mha_sources(full, f"{name}.full_kv_pool")),
                GroupSpec("swa", slots_of(swa), mha_sources(swa, f"{name}.swa_kv_pool"), window, lut, loc="swa"),
            ]
        if kind == "mla":
            srcs: tuple = ()
            if want_sources:
                idx = resolve_layers(layers, len(pool.kv_buffer), 1, name)
                srcs = tuple(token_major_source(pool.kv_buffer[i], slots_of(pool), pool.page_size) for i in idx)
            return [GroupSpec("full", slots_of(pool), srcs)]
        if isinstance(pool, mha_cls) and hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
            return [GroupSpec("full", slots_of(pool), mha_sources(pool, name))]
    except ValueError as exc:
        if "KVCANARY_" in str(exc):
            raise
        raise NotImplementedError(f"kvcanary: KV pool {name}: its buffers cannot be fingerprinted: {exc}") from exc
    raise NotImplementedError(
        f"kvcanary: KV pool {name} is not supported by the sglang {sglang_version} adapter "
        f"(supported: {', '.join(c.rsplit('.', 1)[-1] for c in (classes.mha, classes.mla, classes.swa))})"
    )
