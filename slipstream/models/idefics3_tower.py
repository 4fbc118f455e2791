"""Idefics3's and SmolVLM's image side (SigLIP-style tower + pixel-shuffle connector), run by
slipstream over transformers' own modules with every index built on the host
(data/idefics3_meta.py).

transformers' `get_image_features` reads the batch on the host three times (the real crops
by a boolean index, the mask cut the same way, the per-image split) and its patch embedding
derives position ids from the mask on the device. Here:
- the patch embedding is transformers' `patch_embedding` convolution plus its position table
  at the host-built position ids;
- each encoder layer is transformers' own module, called with no mask when every crop is
  whole, else the crops' key mask (additive, built on the device from the host-built bool
  mask: no sync);
- `post_layernorm` and the connector (pixel shuffle, projection) are transformers'.
Crops keep their padding: transformers' connector takes every patch of a crop, padding
patches too (they attend the real ones), so dropping them would change the features.
Names are unchanged, so LoRA on the tower and saved adapters are transformers' + peft's.

Shapes: N crops, S patches a crop, D tower width, Q = N * S / scale^2 feature rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slipstream.data.idefics3_meta import KEY_MASK, POSITION_IDS


def image_features(vision_model: nn.Module, connector: nn.Module, images: dict[str, Any]):
    """(Q, D_text): every crop's connector rows, in order (what `get_image_features` gives,
    concatenated). `images`: `pixel_values` (N, C, H, W) and data/idefics3_meta.py's KEYS."""
    embeddings = vision_model.embeddings
    conv = embeddings.patch_embedding
    pixels = images["pixel_values"].to(conv.weight.dtype)
    x_NSD = conv(pixels).flatten(2).transpose(1, 2)
    x_NSD = x_NSD + embeddings.position_embedding(images[POSITION_IDS])
    mask = None
    if KEY_MASK in images:  # (N, 1, 1, S): padding patches are no keys
        keys = images[KEY_MASK][:, None, None, :]
        mask = torch.zeros(keys.shape, dtype=x_NSD.dtype, device=x_NSD.device)
        mask = mask.masked_fill(~keys, torch.finfo(x_NSD.dtype).min)
    for layer in vision_model.encoder.layers:
        x_NSD = layer(x_NSD, attention_mask=mask)
    feats = connector(vision_model.post_layernorm(x_NSD))
    return feats.reshape(-1, feats.shape[-1])
