"""What the native image-text families' tests check the same way: image rows keep
`implementation: auto` native (transformers' code stays the reference), and a 2-step CLI run
on image rows is native and its adapter loads in peft with LoRA on the tower and the
language model."""

from __future__ import annotations

import json
from pathlib import Path

from peft import PeftModel

import slipstream
from helpers.tiny_vlm import run_config, write_picture_rows


def assert_image_rows_keep_auto_native(folder: Path, examples: list) -> None:
    from slipstream.config import load_config
    from slipstream.train.setup import image_implementation

    cfg = load_config(None, [f"model.path={folder}", "data.train=d.jsonl", "output_dir=o"])
    assert image_implementation(cfg, examples) is None
    ref = slipstream.load_model(folder, implementation="transformers")
    assert type(ref).__name__ == "GenericImageTextLM"


def assert_cli_run_is_native_and_loads_in_peft(folder, tmp_path, capsys, hf, **sections) -> None:
    """A 2-step `slipstream train` on two image rows with `vision.tower: lora` (plus
    `sections`); `hf(folder)` builds transformers' model the adapter is loaded on."""
    from slipstream import cli

    data, out = write_picture_rows(tmp_path, [(40, 60), (30, 30)]), tmp_path / "out"
    config = run_config(tmp_path / "run.yaml", folder, data, out, vision={"tower": "lora"},
                        **sections)  # fmt: skip
    assert cli.main(["train", str(config)]) == 0
    log = "".join(capsys.readouterr())
    assert "native family" in log and "transformers' image-text" not in log
    losses = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in losses if "loss" in r] == [1, 2]
    peft_model = PeftModel.from_pretrained(hf(folder), out)
    lora_a = [n for n, _ in peft_model.named_modules() if n.endswith(".lora_A")]
    assert any("vision_tower" in n for n in lora_a) and any("language_model" in n for n in lora_a)
