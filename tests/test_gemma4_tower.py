"""Gemma 4's image side run by slipstream (models/gemma4_tower.py, data/gemma4_meta.py)
against transformers' own `get_image_features` on the same weights: four images of three
grids in one call (each padded to the processor's max_patches on transformers' side, real
patches only on ours), the features and the gradients of every tower and embedder weight,
float32; with the tower's clipped linears and standardization on, too; 0 host syncs where
transformers' tower makes some."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from helpers.tiny_vlm import assert_tower_grads_match, random_image, vlm_folder

import slipstream
from slipstream.data import gemma4_meta
from slipstream.models import gemma4_tower

SIZES = [(40, 60), (24, 24), (60, 30), (40, 60)]  # pixels; the processor keeps the aspect


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    folder = vlm_folder(tmp_path_factory.mktemp("gemma4"), "gemma4")
    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    images = [random_image(h, w, seed=h + 3 * w + k) for k, (h, w) in enumerate(SIZES)]
    inputs = processor(images=images, return_tensors="pt")
    return folder, {k: inputs[k] for k in ("pixel_values", "image_position_ids")}


def _model(folder, variant: bool):
    """The checkpoint with its tower's q/k norms scaled up (a sharper attention, so that
    positions show); `variant`: clipped linears and standardization on, with finite clip
    bounds and a random std bias and scale."""
    config = transformers.AutoConfig.from_pretrained(folder)
    if variant:
        config.vision_config.use_clipped_linears = True
        config.vision_config.standardize = True
    torch.manual_seed(0)
    hf = transformers.AutoModelForImageTextToText.from_config(config).float()
    tower = hf.model.vision_tower
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
        for layer in tower.encoder.layers:
            layer.self_attn.q_norm.weight.mul_(4)
            layer.self_attn.k_norm.weight.mul_(4)
        if variant:
            for name, buf in tower.named_buffers():
                if name.endswith(("input_min", "output_min")):
                    buf.fill_(-1.5)
                elif name.endswith(("input_max", "output_max")):
                    buf.fill_(1.5)
            tower.std_bias.copy_(torch.randn_like(tower.std_bias))
            tower.std_scale.copy_(torch.rand_like(tower.std_scale) + 0.5)
    return hf


def _theirs(hf, inputs):
    out = hf.model.get_image_features(**inputs, return_dict=True)
    return torch.cat(list(out.pooler_output))


def _ours(hf, inputs):
    fields = gemma4_meta.gemma4_metadata(inputs["pixel_values"], inputs["image_position_ids"], 3)
    return gemma4_tower.image_features(hf.model.vision_tower, hf.model.embed_vision, fields)


@pytest.mark.parametrize("variant", [False, True], ids=["plain", "clipped+standardized"])
def test_features_and_gradients_equal_transformers(gemma4, variant):
    folder, inputs = gemma4
    theirs_model = _model(folder, variant)
    ours_model = copy.deepcopy(theirs_model)
    theirs, ours = _theirs(theirs_model, inputs), _ours(ours_model, inputs)
    real = (inputs["image_position_ids"] != -1).all(-1).sum(-1)
    assert ours.shape == theirs.shape and ours.shape[0] == int(real.sum()) // 9
    assert len(set(real.tolist())) == 3  # three grids, each image its own length
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert_tower_grads_match(ours, theirs, ours_model, theirs_model)


def test_positions_matter_and_the_pooling_order_is_checked(gemma4):
    """Swapped (x, y) positions give other features (the 2-D RoPE and the table are
    checked), and so does pooling in the processor's row-major order instead of by block."""
    folder, inputs = gemma4
    hf = _model(folder, False)
    fields = gemma4_meta.gemma4_metadata(inputs["pixel_values"], inputs["image_position_ids"], 3)
    with torch.no_grad():
        right = gemma4_tower.image_features(hf.model.vision_tower, hf.model.embed_vision, fields)
        swapped = dict(fields, **{gemma4_meta.POSITIONS: fields[gemma4_meta.POSITIONS].flip(-1)})
        wrong = gemma4_tower.image_features(hf.model.vision_tower, hf.model.embed_vision, swapped)
        assert not torch.allclose(right, wrong, atol=1e-4)
        real = (inputs["image_position_ids"][0] != -1).all(-1)
        n = int(real.sum())
        row_major = {
            gemma4_meta.PATCHES: inputs["pixel_values"][0][real],
            gemma4_meta.POSITIONS: inputs["image_position_ids"][0][real],
            gemma4_meta.SEQ: slipstream.SeqInfo.from_lengths([n]),
        }
        unordered = gemma4_tower.image_features(
            hf.model.vision_tower, hf.model.embed_vision, row_major
        )
        assert not torch.allclose(right[: n // 9], unordered, atol=1e-4)


def test_host_metadata_drops_padding_and_groups_each_pooling_block(gemma4):
    _, inputs = gemma4
    fields = gemma4_meta.gemma4_metadata(inputs["pixel_values"], inputs["image_position_ids"], 3)
    real = (inputs["image_position_ids"] != -1).all(-1).sum(-1).tolist()
    assert fields[gemma4_meta.SEQ].lengths == tuple(real)
    pos = fields[gemma4_meta.POSITIONS][: real[0]]
    width = int(pos[:, 0].max()) + 1
    blocks = (pos[:, 0] // 3 + (width // 3) * (pos[:, 1] // 3)).view(-1, 9)
    assert (blocks == blocks[:, :1]).all()  # each 9 consecutive rows: one block
    assert blocks[:, 0].tolist() == list(range(real[0] // 9))  # in transformers' pooled order
    # A patch row is the processor's patch at that position.
    px, ids = inputs["pixel_values"][0], inputs["image_position_ids"][0]
    at = [i for i in range(len(ids)) if ids[i].tolist() == pos[5].tolist()][0]
    torch.testing.assert_close(fields[gemma4_meta.PATCHES][5], px[at])
    with pytest.raises(ValueError, match="does not tile"):
        gemma4_meta.pooled_order(torch.tensor([[x, y] for y in range(3) for x in range(4)]), 3)


def test_no_host_sync_where_transformers_tower_has_some(gemma4):
    folder, inputs = gemma4
    hf = _model(folder, False)
    fields = gemma4_meta.gemma4_metadata(inputs["pixel_values"], inputs["image_position_ids"], 3)
    with slipstream.count_syncs() as ours:
        _ours_features = gemma4_tower.image_features(
            hf.model.vision_tower, hf.model.embed_vision, fields
        )
        _ours_features.sum().backward()
    with slipstream.count_syncs() as theirs:
        _theirs(hf, inputs)
    assert ours.total == 0, ours
    assert theirs.total > 0  # transformers' tower reads lengths and strips padding on the host
