"""The memory plan of image-text checkpoints: the language model's shape from its text config,
the tower and projector in the weights, `vision.tower` in the trainable bytes, and the meta
step over the worst-case image micro-batch (memory/probe_images.py) within 10% of a real CPU
step over the same batch (frozen tower and tower LoRA); a real data batch stays under the
estimate; `slipstream plan` and the train-time plan run, and a run that will not fit stops in
one line."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers.tiny_vlm import run_config, vlm_folder, write_picture_rows

from slipstream.cli import main
from slipstream.config import RunConfig
from slipstream.memory import plan as planner
from slipstream.memory.measure import measure_step

RSS = 300 << 20  # the process's own memory, pinned so that budgets are exact
TOKENS = 512


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("vlm_plan")


@functools.cache
def _folder(root, kind: str):
    return vlm_folder(root / kind, kind)


def _inputs(folder, tower: str = "frozen", implementation: str = "auto") -> planner.PlanInputs:
    return planner.PlanInputs(
        hf=planner.read_hf_config(str(folder)), device="cpu", dtype=torch.float32,
        quantization="none", method="lora", rank=8, alpha=16, targets="all-linear",
        use_dora=False, optimizer="adamw", tokens=TOKENS, mode="auto", tiles="auto",
        prepack=False, world=1, implementation=implementation, vision_tower=tower,
        model_path=str(folder),
    )  # fmt: skip


def _measured(folder, batch, tower: str, implementation: str = "auto") -> int:
    """A real CPU step's live-tensor peak: the run's setup order (train/setup.py)."""
    from slipstream.checkpoint.hf import load_model
    from slipstream.memory.offload import apply_checkpointing
    from slipstream.peft.lora import apply_lora
    from slipstream.peft.vision import vision_training
    from slipstream.train.optim import build_optimizer

    model = load_model(folder, implementation=implementation)
    vision = SimpleNamespace(tower=tower, projector="frozen")
    vision_training(model, vision, "lora", before_lora=True)
    apply_lora(model, rank=8, alpha=16, targets="all-linear")
    vision_training(model, vision, "lora", before_lora=False)
    apply_checkpointing(model, "recompute", force=True, min_offload_bytes=0)
    optimizer = build_optimizer(
        model.named_parameters(), lr=1e-4, weight_decay=0.0, device=torch.device("cpu")
    )
    return measure_step(model, optimizer, [], batch=batch).live_peak


def _tensor_bytes(plan) -> int:
    return plan.peak - plan.components["process (libraries, heap)"]


@pytest.mark.parametrize(
    "kind,tower,implementation",
    [("qwen2_5_vl", "frozen", "auto"), ("qwen2_5_vl", "lora", "auto"),
     ("gemma3", "frozen", "auto"), ("gemma3", "frozen", "transformers"),
     ("llava", "lora", "auto")],
)  # fmt: skip
def test_image_estimate_within_10_percent_of_measured(root, kind, tower, implementation):
    """The same worst-case micro-batch, on meta and for real (its pixels zeros): the plan's
    tensors and, apart, its activations (less the image inputs) within 10%."""
    from slipstream.memory.probe_images import image_side, worst_case_batch

    folder = _folder(root, kind)
    plan = planner.estimate(_inputs(folder, tower, implementation), TOKENS, "recompute", 1)
    assert "image side" in plan.notes[0] and f"vision.tower={tower}" in plan.notes[0]
    batch = worst_case_batch(*image_side(str(folder)), TOKENS, device="cpu")
    measured = _measured(folder, batch, tower, implementation)
    inputs = plan.components["image inputs (pixels, tower metadata)"]
    assert inputs == sum(t.numel() * t.element_size() for t in batch.tensors())
    assert abs(_tensor_bytes(plan) - measured) <= 0.10 * measured, (plan.components, measured)
    rest, measured_rest = _tensor_bytes(plan) - inputs, measured - inputs
    assert abs(rest - measured_rest) <= 0.10 * measured_rest


def test_tower_lora_and_full_reach_the_plan(root):
    folder = _folder(root, "qwen2_5_vl")
    frozen = planner.estimate(_inputs(folder), TOKENS, "recompute", 1).components
    lora = planner.estimate(_inputs(folder, "lora"), TOKENS, "recompute", 1).components
    assert lora["adapters"] > frozen["adapters"]  # the tower's linears wrapped too
    assert lora["optimizer states"] == 2 * lora["adapters"]
    key = "activations (one layer's recompute + backward)"
    assert lora[key] > frozen[key]  # the tower's saved activations
    inp = _inputs(folder, "full")
    inp.method = "full"
    full = planner.estimate(inp, TOKENS, "recompute", 1).components
    inp.vision_tower = "frozen"
    text_only = planner.estimate(inp, TOKENS, "recompute", 1).components
    assert full["gradients"] > text_only["gradients"]


def test_real_data_batch_stays_under_the_estimate(root):
    """Rows of real pictures packed to the budget: the worst case covers them (the
    over-estimate printed: its size is the price of not knowing the data)."""
    from slipstream.checkpoint.tokenizer import load_tokenizer
    from slipstream.data import collate
    from slipstream.data.vision import ImageProcessing, image_inputs
    from slipstream.memory.probe_images import ImageBatch

    folder = _folder(root, "qwen2_5_vl")
    data = write_picture_rows(root / "rows", [(56, 56), (28, 56), (112, 84)], n=60)
    tokenizer = load_tokenizer(str(folder))
    side = ImageProcessing.from_model(str(folder), tokenizer)
    examples, total = [], 0
    for line in data.read_text().splitlines():
        row = yaml.safe_load(line)
        row["images"] = [str(root / "rows" / p) for p in row["images"]]
        ex = side.encode(row, tokenizer, "assistant")
        if total + len(ex) > TOKENS:
            break
        examples.append(ex)
        total += len(ex)
    b = collate(examples)
    batch = ImageBatch(b.input_ids, b.seq, image_inputs(b.fields), "")
    for tower in ("frozen", "lora"):
        plan = planner.estimate(_inputs(folder, tower), TOKENS, "recompute", 1)
        measured = _measured(folder, batch, tower)
        print(f"{tower}: estimate {_tensor_bytes(plan)} B, real batch of {total} tokens "
              f"{measured} B: x{_tensor_bytes(plan) / measured:.2f}")  # fmt: skip
        assert _tensor_bytes(plan) >= measured


@pytest.fixture
def fixed_rss(monkeypatch):
    monkeypatch.setattr(planner, "_rss_now", lambda: RSS)


def _config(root, tmp_path, kind: str, **sections):
    data = write_picture_rows(root / "pics_rows", [(56, 56)], n=4)
    path = run_config(tmp_path / "c.yaml", _folder(root, kind), data, tmp_path / "run", **sections)
    return path


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "gemma3", "llava"])
def test_train_time_plan_runs(root, tmp_path, kind, fixed_rss):
    """The plan `train` runs first is made (not skipped) and probes the images."""
    said = []
    cfg = RunConfig.model_validate(yaml.safe_load(_config(root, tmp_path, kind).read_text()))
    plan = planner.plan_for_run(cfg, "cpu", budget=8 << 30, say=said.append)
    assert plan is not None and not said, said
    assert plan.components["image inputs (pixels, tower metadata)"] > 0
    assert any(n.startswith("image side") for n in plan.notes)


def test_plan_command_prints_the_components(root, tmp_path, fixed_rss, capsys):
    path = _config(root, tmp_path, "qwen2_5_vl", vision={"tower": "lora"})
    assert main(["plan", str(path), "--device", "cpu", "--memory", "0.32GB"]) == 0
    text = capsys.readouterr().out
    for part in ("weights", "adapters", "image inputs (pixels, tower metadata)", "peak",
                 "fits", "note: image side", "vision.tower=lora"):  # fmt: skip
        assert part in text, text


def test_a_run_that_does_not_fit_stops_in_one_line(root, tmp_path, monkeypatch, fixed_rss, capsys):
    path = _config(
        root,
        tmp_path,
        "qwen2_5_vl",
        train={"activation_checkpointing": "recompute", "mlp_tiles": "off"},
    )
    cfg = RunConfig.model_validate(yaml.safe_load(path.read_text()))
    inp = planner.PlanInputs.from_config(cfg, "cpu", planner.read_hf_config(cfg.model.path))
    peak = planner.estimate(inp, 256, "recompute", 1).peak
    monkeypatch.setattr(planner, "device_budget", lambda device: peak - (1 << 12))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.tokens_per_batch=256 needs" in err, err
    assert not (tmp_path / "run").exists()


def test_a_tower_the_probe_cannot_run_is_said(root, monkeypatch):
    """No traceback and no silent gap: the text side is planned, a note says what is not."""
    from slipstream.memory import probe_images

    def broken(*args, **kwargs):
        raise RuntimeError("no meta kernel")

    monkeypatch.setattr(probe_images, "worst_case_batch", broken)
    folder = _folder(root, "qwen2_5_vl")
    plan = planner.estimate(_inputs(folder, "lora"), 320, "recompute", 1)
    assert "image inputs (pixels, tower metadata)" not in plan.components
    assert "NOT included" in plan.notes[0] and "no meta kernel" in plan.notes[0]
