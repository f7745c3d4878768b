"""fp8 KV caches: per-layer, per-tensor key/value scales, fixed or calibrated on the engine's
first forward pass (its first prompt chunks)."""

from __future__ import annotations

import math

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

#: ``kv_scale="auto"`` maps the amax of the first forward pass's keys (values) of a layer to
#: ``finfo(fp8).max / KV_SCALE_HEADROOM``: later tokens up to this many times larger than
#: anything seen during calibration are still represented without saturating.
KV_SCALE_HEADROOM = 4.0


def make_kv_scales(kv_cache_dtype: torch.dtype, kv_scale, num_layers: int, device):
    """``(k_scales, v_scales, calibrate, scale_target)`` for a cache of ``kv_cache_dtype``:
    one fp32 one-element tensor per layer (``None``, ``None`` for non-fp8 caches);
    ``calibrate``: the first forward pass sets them (``kv_scale="auto"``), mapping each amax to
    ``scale_target``. ``ValueError`` naming ``kv_scale`` for a bad value."""
    if kv_cache_dtype not in FP8_DTYPES:
        return None, None, False, 1.0
    calibrate, target = False, 1.0
    if isinstance(kv_scale, str):
        if kv_scale != "auto":
            raise ValueError(f"kv_scale must be 'auto', a float or a pair, got {kv_scale!r}")
        ks = vs = 1.0  # until the first forward pass calibrates them
        calibrate = True
        target = torch.finfo(kv_cache_dtype).max / KV_SCALE_HEADROOM
    elif isinstance(kv_scale, (int, float)):
        ks = vs = float(kv_scale)
    else:
        ks, vs = (float(v) for v in kv_scale)
    if not (ks > 0 and vs > 0 and math.isfinite(ks) and math.isfinite(vs)):
        raise ValueError(f"kv_scale must be positive and finite, got {kv_scale!r}")
    k_scales = [torch.tensor([ks], dtype=torch.float32, device=device) for _ in range(num_layers)]
    v_scales = [torch.tensor([vs], dtype=torch.float32, device=device) for _ in range(num_layers)]
    return k_scales, v_scales, calibrate, target


def calibrate_scales(key: torch.Tensor, value: torch.Tensor, k_scale: torch.Tensor,
                     v_scale: torch.Tensor, target: float) -> None:
    """Per-tensor scales from one step's keys/values, in place: amax maps to ``target``
    (``fmax / headroom``); an all-zero tensor keeps scale 1."""
    for t, sc in ((key, k_scale), (value, v_scale)):
        amax = t.detach().abs().amax().float()
        sc.copy_(torch.where(amax > 0, amax / target, torch.ones_like(amax)).reshape(sc.shape))
