"""Peak host memory of loading an FP8 checkpoint (dequantised to bf16 while it loads:
checkpoint/fp8.py) against its bf16 twin, each load in a fresh process.

A random Llama (hidden 1024, MLP 2816, 12 layers, vocab 32000: 205M parameters) is saved in
bf16, and again with its decoder projections as float8_e4m3fn in 128x128 blocks with their
`weight_scale_inv` (tests/helpers/fp8.py). Each child process imports slipstream, notes its
RSS, runs `load_model(folder, dtype=bf16)` (native family, then transformers' modeling
code) and reports its peak RSS (VmHWM) above that,
beside the model's own bytes. Predicted: the FP8 load peaks no higher than the bf16 twin's
(model + the file pages it reads, which are smaller for FP8) and far below the model plus a
full-precision copy. `--quick`: 2 layers, vocab 4096.

    python benchmarks/bench_fp8_load.py [--quick] [--dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_folders(root: Path, quick: bool) -> tuple[Path, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.fp8 import to_fp8

    config = LlamaConfig(
        vocab_size=4096 if quick else 32000, hidden_size=1024, intermediate_size=2816,
        num_hidden_layers=2 if quick else 12, num_attention_heads=8, num_key_value_heads=4,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    bf16, fp8 = root / "bf16", root / "fp8"
    model.save_pretrained(bf16)
    model.save_pretrained(fp8)
    to_fp8(fp8, block=(128, 128))
    return bf16, fp8


def status(key: str) -> int:
    """Bytes of a /proc/self/status line: VmRSS now, VmHWM the peak of this process image
    (not ru_maxrss: Linux carries that over from the parent across fork + exec, and the
    parent built the 205M-parameter model in float32)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status (Linux only)")


def child(folder: str, implementation: str) -> None:
    import torch

    from slipstream.checkpoint.hf import load_model

    before = status("VmRSS")
    model = load_model(folder, dtype=torch.bfloat16, implementation=implementation)
    peak = status("VmHWM")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    files = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    print(json.dumps({
        "checkpoint": Path(folder).name, "implementation": implementation,
        "file_mb": round(files / 1e6), "model_mb": round(size / 1e6),
        "rss_before_mb": round(before / 1e6), "peak_above_mb": round((peak - before) / 1e6),
        "loaded_as": model.base_quantization,
    }))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--child", default=None)
    parser.add_argument("--implementation", default="native")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.implementation)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folders = make_folders(Path(tmp), args.quick)
        for implementation in ("native", "transformers"):
            for folder in folders:
                cmd = [sys.executable, __file__, "--child", str(folder)]
                cmd += ["--implementation", implementation]
                out = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
