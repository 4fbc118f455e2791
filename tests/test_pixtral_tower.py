"""Mistral 3's image side run by slipstream (models/pixtral_tower.py) against transformers'
own `get_image_features` on the same weights: three images of three sizes in one call, the
features and the gradients of every tower and projector weight (full), float32."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.tiny_vlm import assert_tower_grads_match, random_image, vlm_folder

from slipstream.data import pixtral_meta
from slipstream.models import pixtral_tower

SIZES = [(40, 60), (20, 30), (56, 14)]


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    folder = vlm_folder(tmp_path_factory.mktemp("mistral3"), "mistral3")
    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    images = [random_image(h, w, seed=h + w) for h, w in SIZES]
    return folder, processor(images=images, return_tensors="pt")


def _model(folder):
    """The checkpoint with its tower's queries and keys scaled up, so that the random
    tower's attention is far from uniform and positions show in its output."""
    hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for layer in hf.model.vision_tower.transformer.layers:
            layer.attention.q_proj.weight.mul_(20)
            layer.attention.k_proj.weight.mul_(20)
    return hf


def _theirs(hf, inputs):
    out = hf.model.get_image_features(
        pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"],
        vision_feature_layer=hf.config.vision_feature_layer, return_dict=True,
    )  # fmt: skip
    return torch.cat(list(out.pooler_output))


def _fields(hf, inputs):
    geo = pixtral_meta.PixtralGeometry.of(hf.config.to_dict())
    sizes = inputs["image_sizes"].tolist()
    return pixtral_meta.pixtral_metadata(inputs["pixel_values"], sizes, geo)


def _ours(hf, fields):
    return pixtral_tower.image_features(
        hf.model.vision_tower, hf.model.multi_modal_projector, hf.config.vision_feature_layer,
        hf.config.spatial_merge_size, fields,
    )  # fmt: skip


def test_features_and_gradients_equal_transformers(mistral3):
    folder, inputs = mistral3
    theirs_model, ours_model = _model(folder), _model(folder)
    theirs, ours = _theirs(theirs_model, inputs), _ours(ours_model, _fields(ours_model, inputs))
    assert ours.shape == theirs.shape and ours.shape[0] == sum(
        (h // 14) * (w // 14) for h, w in inputs["image_sizes"].tolist()
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert_tower_grads_match(ours, theirs, ours_model, theirs_model)


def test_the_rotary_positions_matter(mistral3):
    """Transposed (row, column) positions give other features: the 2-D RoPE is checked."""
    folder, inputs = mistral3
    hf = _model(folder)
    fields = _fields(hf, inputs)
    with torch.no_grad():
        right = _ours(hf, fields)
        fields[pixtral_meta.POSITIONS] = fields[pixtral_meta.POSITIONS].flip(-1)
        wrong = _ours(hf, fields)
    assert not torch.allclose(right, wrong, atol=1e-4)


def test_host_fields_cut_each_images_patches_without_padding(mistral3):
    _, inputs = mistral3
    geo = pixtral_meta.PixtralGeometry(patch=7, merge=2)
    sizes = inputs["image_sizes"].tolist()
    fields = pixtral_meta.pixtral_metadata(inputs["pixel_values"], sizes, geo)
    grids = [(h // 7, w // 7) for h, w in inputs["image_sizes"].tolist()]
    lengths = fields[pixtral_meta.SEQ].lengths
    assert lengths == tuple(h * w for h, w in grids)
    assert fields[pixtral_meta.PATCHES].shape == (sum(lengths), 3 * 7 * 7)
    # The first image's patch at (row 1, column 2) is its pixels there.
    px = inputs["pixel_values"][0, :, 7:14, 14:21].reshape(-1)
    w = grids[0][1]
    torch.testing.assert_close(fields[pixtral_meta.PATCHES][1 * w + 2], px)
    assert fields[pixtral_meta.POSITIONS][1 * w + 2].tolist() == [1, 2]
    # Each merged row takes one 2 x 2 block; a grid's odd last row or column is dropped, as
    # transformers' unfold drops it (21 x 35 px: 3 x 5 patches, 1 x 2 blocks).
    index = fields[pixtral_meta.MERGE_INDEX].tolist()
    blocks = sum((h // 2) * (w // 2) for h, w in grids)
    assert len(index) == 4 * blocks and len(set(index)) == len(index)
    assert (3, 5) in grids
