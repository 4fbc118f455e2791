"""The CLI checks the image-prompt objectives (DPO / ORPO / SimPO pairs, KTO rows, GRPO
prompts) share: a
tiny Qwen2.5-VL with six rows whose prompt is one of three pictures (paths relative to the
data file), a 2-step LoRA run with `vision.tower: lora` whose adapter loads in peft, and two
DDP ranks that make one process's losses."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import peft
import torch
import transformers

from helpers.tiny_vlm import run_config, vlm_folder, write_images


def turn(role: str, text: str) -> list[dict]:
    return [{"role": role, "content": [{"type": "text", "text": text}]}]


def image_prompt_run(
    tmp_path: Path, name: str, objective: str, answer: Callable[[int], dict],
    sections: dict | None = None, **train,
) -> tuple[Path, Path]:  # fmt: skip
    """(model folder, config path) of a 2-step `objective` run on six rows: row i asks "Which
    is it?" of picture i % 3 and `answer(i)` gives its other columns (chosen/rejected,
    completion/label; none for GRPO); `sections`: more config sections (`grpo`)."""
    folder = tmp_path / "model"
    if not folder.exists():
        vlm_folder(folder, "qwen2_5_vl")
        (tmp_path / "pics").mkdir()
        names = write_images(tmp_path / "pics", [(40, 60), (56, 56), (30, 80)])
        rows = []
        for i in range(6):
            parts = [{"type": "image"}, {"type": "text", "text": "Which is it?"}]
            rows.append({"prompt": [{"role": "user", "content": parts}],
                         "images": [f"pics/{names[i % 3]}"], **answer(i)})  # fmt: skip
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = {"objective": objective, "tokens_per_batch": 512, **train}
    config = run_config(tmp_path / f"{name}.yaml", folder, tmp_path / "rows.jsonl",
                        tmp_path / name, vision={"tower": "lora"}, train=train,
                        **(sections or {}))  # fmt: skip
    return folder, config


def assert_cli_run_moves_a_tower_adapter(folder: Path, config: Path, capsys, metric: str) -> None:
    """`slipstream train` reads all six rows, logs `metric` at steps 1 and 2, and its adapter
    loads in peft with moved B factors, on the tower too."""
    from slipstream import cli

    assert cli.main(["train", str(config)]) == 0
    text = "".join(capsys.readouterr())
    assert "6 rows -> 6 examples" in text and "skipped 0" in text
    out = config.parent / config.stem
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2] and all(metric in m for m in steps)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    lora_b = {n: p for n, p in peft.PeftModel.from_pretrained(hf, out).named_parameters()
              if "lora_B" in n}  # fmt: skip
    assert any(p.abs().max() > 0 for p in lora_b.values())  # two steps moved the adapter
    assert any(".visual." in n for n in lora_b)  # vision.tower: lora


def assert_two_ranks_match_one_process(tmp_path: Path, make_run: Callable) -> None:
    """`make_run(tmp_path, name, **train)` -> (folder, config): two DDP ranks at grad_accum 1
    make the losses one process makes at grad_accum 2 (1e-4 rel)."""
    import yaml

    from helpers.runs import losses
    from helpers.torchrun import check, train_job
    from slipstream import cli

    _, single = make_run(tmp_path, "single", grad_accum=2, tokens_per_batch=256)
    assert cli.main(["train", str(single)]) == 0
    _, ddp = make_run(tmp_path, "ddp", parallel="ddp", tokens_per_batch=256)
    check(train_job(yaml.safe_load(ddp.read_text()), tmp_path))
    one, two = losses(tmp_path / "single"), losses(tmp_path / "ddp")
    assert sorted(one) == sorted(two) == [1, 2]
    assert all(abs(one[s] - two[s]) <= 1e-4 * abs(one[s]) for s in one), (one, two)


def hf_vlm(folder: Path):
    """transformers' image-text model of `folder`, float32."""
    return transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)


def peft_vlm(folder: Path, adapter: Path):
    """`hf_vlm` with `adapter` loaded in peft, trainable."""
    return peft.PeftModel.from_pretrained(hf_vlm(folder), adapter, is_trainable=True)


def lora_vlm(root: Path, kind: str, implementation: str = "auto", tower_lora: bool = False):
    """(folder, tokenizer, image side, our model with LoRA r4 on it) of a tiny `kind`;
    `tower_lora`: the tower's linears get adapters too (`vision.tower: lora`)."""
    import slipstream
    from slipstream.data.vision import ImageProcessing

    folder = vlm_folder(root / kind, kind)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    side = ImageProcessing.from_model(str(folder), tok)
    model = slipstream.load_model(folder, implementation=implementation)
    if tower_lora:
        model.no_lora_prefixes = ()  # what train/setup.py sets for vision.tower: lora
    torch.manual_seed(0)
    slipstream.apply_lora(model, rank=4, alpha=8)
    return folder, tok, side, model
