"""What keeping image sources instead of pixels saves and costs (data/vision.py): host memory
after tokenizing `--images` image rows (448 x 448 PNGs, one a row, at Qwen2.5-VL's own
resolution: 1,024 patches, 256 image tokens, 4.8 MB of float32 patches an image) for a tiny
Qwen2.5-VL, and the time `collate` takes for a batch of `--batch` of them.

Memory is the process's resident set (/proc/self/status: VmRSS after tokenizing, VmHWM its
peak) minus VmRSS before, in a fresh process. The same script measures the code before the
change (examples that hold their pixels) when run against that tree:

    PYTHONPATH=/path/to/old/tree python benchmarks/bench_vision_pixels.py
    python benchmarks/bench_vision_pixels.py          # this tree
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def full_resolution(folder: Path) -> None:
    """The tiny checkpoint's image processor at Qwen2.5-VL's own pixel limits."""
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    pre.update(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    pre["size"] = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)

    import transformers
    from helpers.tiny_vlm import vlm_folder, write_picture_rows

    import slipstream
    from slipstream.data import collate, tokenize_rows
    from slipstream.data.images import images_relative_to
    from slipstream.data.vision import ImageProcessing

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = vlm_folder(root / "model", "qwen2_5_vl")
        full_resolution(folder)
        # One 448 x 448 picture a row, each its own (random, seeded by its number).
        data = write_picture_rows(root, [(448, 448)] * args.images, n=args.images)
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        side = ImageProcessing.from_model(str(folder), tok)
        with images_relative_to(data):
            collate(tokenize_rows(rows[:1], tok, max_tokens=4096, images=side)[0])  # warm
            before = status_mib("VmRSS")
            start = time.perf_counter()
            examples, _ = tokenize_rows(rows, tok, max_tokens=4096, images=side)
            tokenize_s = time.perf_counter() - start
        held, peak = status_mib("VmRSS") - before, status_mib("VmHWM") - before
        batch = examples[: args.batch]
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            out = collate(batch)
            times.append(time.perf_counter() - start)
        result = {
            "code": str(Path(slipstream.__file__).parents[1]),
            "images": args.images, "image_tokens": examples[0].image_tokens,
            "tokenize_s": round(tokenize_s, 2),
            "rss_held_mib": round(held), "rss_peak_mib": round(peak),
            "collate_batch": args.batch, "collate_ms": round(1e3 * statistics.median(times), 1),
            "collate_ms_per_image": round(1e3 * statistics.median(times) / args.batch, 2),
            "batch_pixels_mib": round(out.fields["pixel_values"].nbytes / 2**20, 1),
        }  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
