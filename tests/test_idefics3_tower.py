"""Idefics3's and SmolVLM's image side run by slipstream (models/idefics3_tower.py,
data/idefics3_meta.py) against transformers' own `get_image_features` on the same weights:
six images (26 crops) in one call, and the same with two crops padded (as the processor pads
a smaller image: zero pixels, mask 0), the features and the gradients of every tower and
connector weight, float32; the host position ids equal transformers' device ones; 0 host
syncs where transformers' makes 4."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from helpers.tiny_vlm import assert_tower_grads_match, random_image, vlm_folder

import slipstream
from slipstream.data import idefics3_meta
from slipstream.data.vision import ImageProcessing, cat_images
from slipstream.models import idefics3_tower

SIZES = [(50, 90), (100, 60), (30, 30), (9, 70), (40, 40), (64, 32)]


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def crops(request, tmp_path_factory):
    folder = vlm_folder(tmp_path_factory.mktemp(request.param), request.param)
    side = ImageProcessing.from_model(
        str(folder), transformers.AutoTokenizer.from_pretrained(folder)
    )
    processed = [side.process(random_image(h, w, seed=h + w))[0] for h, w in SIZES]
    pixels = cat_images([p["pixel_values"] for p in processed])
    mask = cat_images([p["pixel_attention_mask"] for p in processed]).bool()
    return folder, side.tower, pixels, mask


def _model(folder):
    """The checkpoint with its tower's attention sharpened (q scaled up), so that which keys
    a patch sees shows in its output."""
    hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for layer in hf.model.vision_model.encoder.layers:
            layer.self_attn.q_proj.weight.mul_(8)
    return hf


def _padded(pixels, mask):
    """Two crops padded at the right and bottom, as the processor pads a smaller image."""
    pixels, mask = pixels.clone(), mask.clone()
    for n, (h, w) in ((0, (28, 14)), (3, (21, 28))):
        pixels[n, :, h:, :], pixels[n, :, :, w:] = 0, 0
        mask[n, h:, :], mask[n, :, w:] = False, False
    return pixels, mask


def _theirs(hf, pixels, mask):
    out = hf.model.get_image_features(
        pixel_values=pixels[:, None], pixel_attention_mask=mask[:, None], return_dict=True
    )  # every crop its own row of the tower's batch, as the generic path calls it
    return torch.cat(list(out.pooler_output))


def _ours(hf, geometry, pixels, mask):
    fields = geometry.metadata({"pixel_values": pixels, "pixel_attention_mask": mask})
    inner = hf.model
    return idefics3_tower.image_features(
        inner.vision_model, inner.connector, {"pixel_values": pixels, **fields}
    )


@pytest.mark.parametrize("padded", [False, True], ids=["whole", "padded"])
def test_features_and_gradients_equal_transformers(crops, padded):
    folder, geometry, pixels, mask = crops
    if padded:
        pixels, mask = _padded(pixels, mask)
    fields = geometry.metadata({"pixel_values": pixels, "pixel_attention_mask": mask})
    assert (idefics3_meta.KEY_MASK in fields) == padded  # no mask when every crop is whole
    theirs_model = _model(folder)
    ours_model = copy.deepcopy(theirs_model)
    theirs = _theirs(theirs_model, pixels, mask)
    ours = _ours(ours_model, geometry, pixels, mask)
    assert ours.shape == theirs.shape and ours.shape[0] == pixels.shape[0] * 4
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert_tower_grads_match(ours, theirs, ours_model, theirs_model)


def test_host_position_ids_equal_transformers_and_the_key_mask_matters(crops):
    folder, geometry, pixels, mask = crops
    pixels, mask = _padded(pixels, mask)
    hf = _model(folder)
    fields = geometry.metadata({"pixel_values": pixels, "pixel_attention_mask": mask})
    patches = idefics3_meta.patch_mask(mask, geometry.patch)
    seen = {}
    embeddings = hf.model.vision_model.embeddings
    hook = embeddings.position_embedding.register_forward_hook(
        lambda m, args, out: seen.update(ids=args[0])  # returns None: output kept
    )
    with torch.no_grad():
        embeddings(pixels, patches)  # transformers' own position ids
        hook.remove()
        assert torch.equal(fields[idefics3_meta.POSITION_IDS], seen["ids"])
        assert len(set(fields[idefics3_meta.POSITION_IDS][0].tolist())) > 1
        right = _ours(hf, geometry, pixels, mask)
        unmasked = {
            "pixel_values": pixels,
            idefics3_meta.POSITION_IDS: fields[idefics3_meta.POSITION_IDS],
        }
        inner = hf.model
        wrong = idefics3_tower.image_features(inner.vision_model, inner.connector, unmasked)
    assert (right[:4] - wrong[:4]).abs().max() > 1e-4  # padding seen as keys: other features


def test_no_host_sync_where_transformers_makes_some(crops):
    folder, geometry, pixels, mask = crops
    pixels, mask = _padded(pixels, mask)
    hf = _model(folder)
    fields = geometry.metadata({"pixel_values": pixels, "pixel_attention_mask": mask})
    inner = hf.model
    with slipstream.count_syncs() as ours:
        feats = idefics3_tower.image_features(
            inner.vision_model, inner.connector, {"pixel_values": pixels, **fields}
        )
        feats.sum().backward()
    with slipstream.count_syncs() as theirs:
        _theirs(hf, pixels, mask)
    assert ours.total == 0, ours
    assert theirs.total > 0  # transformers' real-crop index, mask cut and split
