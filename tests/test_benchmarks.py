"""The benchmarks stay runnable: each CPU bench in `--quick` mode and the GPU suite's CPU
`--dry-run`, run in-process (one torch import for all), with their rows checked.

What could fail and is checked: the per-layer baseline really syncs (2 per layer) while ours
does not; ours builds its mask once whatever the depth; both attention paths agree; packing
beats padding; every family trains with 0 syncs; the suite's rows carry the columns the docs
table needs, its audited ours row reads 0 syncs and its metadata-off row more than 0; the
LM head on labelled positions gives the full loss and gradients at the label density asked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_attention  # noqa: E402
import bench_cpu_step  # noqa: E402
import bench_dpo  # noqa: E402
import bench_eval  # noqa: E402
import bench_gemma4  # noqa: E402
import bench_generate  # noqa: E402
import bench_generic  # noqa: E402
import bench_kto_reward  # noqa: E402
import bench_loss  # noqa: E402
import bench_metadata  # noqa: E402
import bench_moe  # noqa: E402
import bench_packing  # noqa: E402
import bench_peers  # noqa: E402
import bench_qwen3_5  # noqa: E402
import bench_qwen_vit  # noqa: E402
import bench_syncs  # noqa: E402
import bench_vision  # noqa: E402
import bench_vision_pixels  # noqa: E402
import common  # noqa: E402
import gpu_suite  # noqa: E402
import gpu_vision_row  # noqa: E402


def table_header(text: str, columns: list[str]) -> None:
    assert "| " + " | ".join(columns) + " |" in text


def test_metadata_quick(tmp_path, capsys):
    rows = bench_metadata.main(["--quick", "--json", str(tmp_path / "m.json")])
    table_header(capsys.readouterr().out, bench_metadata.COLUMNS)
    assert [r["layers"] for r in rows] == [2, 4]
    for r in rows:
        assert r["ours syncs"] == 0
        assert r["baseline syncs"] == 2 * r["layers"]  # .tolist() and .item() per layer
        assert r["ours mask builds"] == 1
        assert r["baseline mask builds"] == r["layers"]
        assert r["max abs diff"] < 1e-5
        assert r["ours ms"] > 0 and r["baseline ms"] > 0
    assert json.loads((tmp_path / "m.json").read_text())["rows"][0]["layers"] == 2


def test_attention_quick(capsys):
    rows = bench_attention.main(["--quick"])
    table_header(capsys.readouterr().out, bench_attention.COLUMNS)
    assert [(r["T"], r["N"]) for r in rows] == [(64, 8), (256, 2)]
    assert [r["picked"] for r in rows] == ["dense", "per-seq"]
    for r in rows:
        assert r["max diff"] < 1e-5 and r["dense ms"] > 0 and r["per-seq ms"] > 0


def test_cpu_step_quick(capsys):
    rows = bench_cpu_step.main(["--quick", "--profile"])
    out = capsys.readouterr().out
    table_header(out, bench_cpu_step.COLUMNS)
    table_header(out, bench_cpu_step.GROUP_COLUMNS)
    assert [r["variant"] for r in rows] == ["before", "no prepack", "ours"]
    # The same model, data and seed: every variant computes the same loss.
    assert max(r["loss"] for r in rows) - min(r["loss"] for r in rows) < 1e-4
    assert all(r["ms/step"] > 0 for r in rows)


def test_packing_quick(capsys):
    rows = bench_packing.main(["--quick"])
    table_header(capsys.readouterr().out, bench_packing.COLUMNS)
    assert sorted({r["budget"] for r in rows}) == [2048, 4096, 8192]
    for budget in (2048, 4096, 8192):
        packed, padded, grouped = [r for r in rows if r["budget"] == budget]
        assert packed["method"].startswith("packed") and padded["method"] == "padded"
        assert packed["real/computed"] == 1.0
        assert padded["real/computed"] < 1.0
        assert packed["real/budget"] > padded["real/budget"]
        assert packed["steps"] <= grouped["steps"] <= padded["steps"]


def test_pad_batches_respects_budget():
    lengths = [5, 9, 3, 8, 1]
    batches = bench_packing.pad_batches(lengths, list(range(5)), budget=18)
    assert batches == [[0, 1], [2, 3], [4]]  # 2*9 fits 18; 3*9 would not
    assert all(len(b) * max(lengths[i] for i in b) <= 18 for b in batches)


def test_syncs_quick(capsys):
    from slipstream.models import FAMILIES

    rows = bench_syncs.main(["--quick"])
    table_header(capsys.readouterr().out, bench_syncs.COLUMNS)
    labels = sorted([*FAMILIES, *(label for label, _, _ in bench_syncs.VARIANTS)])
    assert sorted(r["model_type"] for r in rows) == labels
    assert any(r["model_type"] == "gemma4_text (MoE)" and r["kind"] == "MoE" for r in rows)
    for r in rows:
        assert r.get("fwd+bwd syncs") == 0, r
        assert r.get("optimizer syncs") == 0, r


def test_rebuild_mask_matches_ours():
    from slipstream.ops.attention import dense_causal_mask
    from slipstream.ops.packing import SeqInfo

    seq = SeqInfo.from_lengths([3, 5, 2])
    for window in (None, 2):
        assert (common.rebuild_mask(seq, window) == dense_causal_mask(seq, window)).all()


def test_suite_flops_are_the_trainers():
    """The suite counts on a meta-device build; the trainer on the real model: same FLOPs."""
    from slipstream.train.flops import StepFlops

    hf = common.hf_config(
        "qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    model = common.build_random_model(hf)
    assert common.step_flops(hf, lora=True)([5, 9]) == StepFlops(model, lora=True)([5, 9])


def check_suite_rows(rows: list[dict], out: str, models: set[str]) -> None:
    text = out[out.rindex("GPU suite:") :]  # the table is printed last
    table_header(text, gpu_suite.COLUMNS)
    assert {r["model"] for r in rows} == models
    errors = [(r["model"], r["variant"], r["status"]) for r in rows if r["status"] != "ok"]
    assert not [e for e in errors if not e[2].startswith("skipped")], errors
    by = {(r["model"], r["variant"]): r for r in rows}
    on = next(r for r in rows if r["variant"] == "ours, everything on")
    assert on["syncs/step"] == 0, on.get("sync sites")
    assert on["tokens/s"] > 0 and on["vs ours"] == 1.0
    meta_off = by.get(("qwen3-8b", "metadata cache off (per-layer rebuild)"))
    if meta_off is not None:
        assert meta_off["syncs/step"] > 0
    hf = next(r for r in rows if r["variant"] == "transformers + PEFT")
    assert hf["packing"].startswith(("packed", "padded")) and hf["tokens/s"] > 0


def test_gpu_suite_dry_run_dense(tmp_path, capsys):
    out = tmp_path / "suite.json"
    rows = gpu_suite.main(["--dry-run", "--only", "qwen3-8b", "--out", str(out)])
    check_suite_rows(rows, capsys.readouterr().out, {"qwen3-8b"})
    assert json.loads(out.read_text())["dry_run"] is True
    variants = {r["variant"] for r in rows}
    assert {"offload single buffer", "offload off (recompute)"} <= variants
    assert "regional compile + everything on" in variants
    gen = next(r for r in rows if r["impl"] == "generate")
    assert gen["generated"] > 0 and gen["tokens/s"] > 0
    assert 0 < gen["syncs/generate"] <= gen["checks bound"]  # one sync a stop check, no more


def test_gpu_suite_dry_run_grpo_row(tmp_path, capsys):
    """The Qwen3-0.6B rows, the GRPO step among them (~10 s): the GPU session must not meet a
    row that broke on the CPU first (its reward stub once lacked `total`)."""
    rows = gpu_suite.main(["--dry-run", "--only", "qwen3-0.6b", "--out", str(tmp_path / "s.json")])
    check_suite_rows(rows, capsys.readouterr().out, {"qwen3-0.6b"})
    assert any(r["variant"].startswith("GRPO step") for r in rows)
    generic = next(r for r in rows if r["impl"] == "generic")  # transformers' Qwen3 code
    assert generic["syncs/step"] == 0 and generic["tokens/s"] > 0, generic.get("sync sites")


@pytest.mark.slow
def test_gpu_suite_dry_run_all(tmp_path, capsys):
    from slipstream.models import FAMILIES

    rows = gpu_suite.main(["--dry-run", "--out", str(tmp_path / "suite.json")])
    models = {"qwen3-0.6b", "qwen3-8b"} | ({"gpt-oss-20b"} if "gpt_oss" in FAMILIES else set())
    models |= {"qwen3.5-9b", "qwen3.5-35b-a3b"}
    models |= {"gemma4-e4b", "gemma4-26b-a4b", "qwen2.5-vl-7b"}
    check_suite_rows(rows, capsys.readouterr().out, models)
    loop = [r for r in rows if r["variant"].startswith("MoE one-pass off")]
    if "gpt_oss" in FAMILIES:
        assert loop and loop[0]["syncs/step"] > 0  # torch.where per expert


def test_gpu_suite_dry_run_image_rows(tmp_path, capsys):
    """The Qwen2.5-VL image row on a tiny model: packed image rows through the native
    family's tower and mRoPE, offload on, no host sync in the step."""
    rows = gpu_suite.main(["--dry-run", "--only", "qwen2.5-vl", "--out", str(tmp_path / "s.json")])
    assert "images/s" in capsys.readouterr().out
    (row,) = rows
    assert row["status"] == "ok", row.get("traceback")
    assert row["syncs/step"] == 0, row.get("sync sites")
    assert row["images"] == 4 and row["images/s"] > 0 and row["tokens/s"] > 0
    assert row["tokens"] > sum(gpu_vision_row.examples(gpu_vision_row.shapes(True), True)[0]
                               .image_tokens)  # fmt: skip


def test_gpu_suite_time_guard_skips(monkeypatch):
    setup = gpu_suite.Setup("cpu", None, [4], 0, 1, False, deadline=0.0)
    row = gpu_suite.run_row(gpu_suite.Variant("x", "qwen3-8b"), setup)
    assert row["status"].startswith("skipped: time guard")


def test_moe_quick(capsys):
    rows = bench_moe.main(["--quick"])
    table_header(capsys.readouterr().out, bench_moe.COLUMNS)
    assert [(r["E"], r["k"]) for r in rows] == [(8, 2), (32, 2)]
    assert all(r["max abs diff"] < 1e-5 and r["ours ms"] > 0 for r in rows)


def test_loss_quick(capsys):
    from slipstream.ops import loss as loss_mod

    backend = loss_mod.USE_TORCH_LCE
    rows = bench_loss.main(["--quick"])
    assert backend == loss_mod.USE_TORCH_LCE  # the bench puts the module switch back
    table_header(capsys.readouterr().out, bench_loss.COLUMNS)
    chat, full = rows
    assert chat["backend"] == full["backend"] == "chunked"
    assert abs(chat["N"] / chat["T"] - 0.38) < 0.02 and full["N"] == full["T"] - 8  # 8 seqs
    assert chat["predicted"] > 1.5 and 1.0 < full["predicted"] < 1.05
    for r in rows:
        assert r["loss rel diff"] < 1e-6 and r["grad rel diff"] < 1e-5, r
        assert r["full ms"] > 0 and r["positions ms"] > 0


def test_generate_quick_tiny(capsys):
    rows = bench_generate.main(["--quick", "--tiny"])
    table_header(capsys.readouterr().out, bench_generate.COLUMNS)
    assert [r["batch"] for r in rows] == [1, 16]
    assert [r["same tokens"] for r in rows] == ["1/1", "16/16"]  # greedy: both sides agree
    assert all(r["ours tok/s"] > 0 and r["transformers tok/s"] > 0 for r in rows)


def test_qwen_vit_quick():
    """Both towers on the same patches: ours without a host sync, transformers' with some."""
    rows = bench_qwen_vit.main(["--quick", "--reps", "1"])
    assert [(r["tower"], r["variant"]) for r in rows] == [
        (t, v) for t in ("qwen2_5_vl", "qwen3_vl") for v in ("transformers", "slipstream")
    ]
    assert [r["syncs"] == 0 for r in rows] == [False, True, False, True]
    assert all(r["ms"] > 0 for r in rows)


def test_vision_trl_quick(capsys):
    """TRL's SFTTrainer and ours train on the same tokens of a tiny Idefics3 (~15 s)."""
    row = bench_vision.main(["--trl", "--quick"])
    assert row["trl_num_tokens"] == row["tokens"] > 0  # TRL's processor: the same ids
    assert row["trl_padded_positions_est"] >= row["tokens"] and row["images"] > row["rows"] // 2
    assert row["slipstream_s"] > 0 and row["trl_s"] > 0 and row["trl_steps"] > 0


def test_vision_pixels_quick(capsys):
    """448x448 rows at Qwen2.5-VL's own resolution: 256 image tokens, 1,024 patches of 1,176
    float32 an image in the collated batch (~5 s)."""
    row = bench_vision_pixels.main(["--images", "4", "--batch", "2", "--reps", "1"])
    assert row["image_tokens"] == [256] and row["collate_ms"] > 0
    assert row["batch_pixels_mib"] == round(2 * 1024 * 1176 * 4 / 2**20, 1)
    assert row["code"] == str(BENCH.parent)  # this tree's slipstream, not another checkout


@pytest.mark.slow  # ~20 s
def test_dpo_quick(capsys):
    """Both sides train on the same tokens; TRL pads them, we do not (~30 s on 1 thread)."""
    row = bench_dpo.main(["--quick"])
    table_header(capsys.readouterr().out, bench_dpo.COLUMNS)
    assert row["same loss (step 1)"] is True  # log 2 on both: fresh adapters, policy = ref
    assert row["padded tokens (TRL)"] >= row["real tokens/step"] > 0
    assert row["TRL tok/s"] > 0 and row["ours tok/s"] > 0


@pytest.mark.slow
def test_qwen3_5_quick(capsys):
    """Native and generic Qwen3.5 (dense, MoE) on one checkpoint: 0 syncs on both, the same
    loss after the same steps from the same adapters (~15 s)."""
    rows = bench_qwen3_5.main(["--quick"])
    table_header(capsys.readouterr().out, bench_qwen3_5.COLUMNS)
    assert [(r["model"], r["variant"]) for r in rows] == [
        (m, v) for m in ("qwen3_5_text", "qwen3_5_moe_text") for v in ("native", "generic")
    ]
    for native, generic in (rows[:2], rows[2:]):
        assert native["syncs/step"] == generic["syncs/step"] == 0
        assert abs(native["loss"] - generic["loss"]) < 1e-3 * generic["loss"]


@pytest.mark.slow
def test_gemma4_quick(capsys):
    """Native and generic Gemma 4 (dense, MoE) on one checkpoint: the same first loss, 0 syncs."""
    rows = bench_gemma4.main(["--quick"])
    table_header(capsys.readouterr().out, bench_generic.COLUMNS)
    assert [r["model"] for r in rows] == ["gemma4_text (dense)"] * 2 + ["gemma4_text (moe)"] * 2
    for native, generic in (rows[:2], rows[2:]):
        assert native["syncs/step"] == generic["syncs/step"] == 0
        assert (
            abs(native["loss (step 0)"] - generic["loss (step 0)"])
            < 1e-4 * generic["loss (step 0)"]
        )


@pytest.mark.slow  # ~10 s
def test_generic_quick(capsys):
    """Native and generic families on one checkpoint give the same loss with 0 syncs; the
    generic packed step and transformers + PEFT's padded one train the same tokens from the
    same start (~20 s of CPU)."""
    rows = bench_generic.main(["--quick"])
    table_header(capsys.readouterr().out, bench_generic.COLUMNS)
    pairs = [rows[i : i + 2] for i in range(0, len(rows), 2)]
    assert [p[0]["model"] for p in pairs[:3]] == ["llama", "qwen3", "qwen3_moe"]
    for native, generic in pairs[:3]:
        assert native["syncs/step"] == generic["syncs/step"] == 0
        first = native["loss (step 0)"]
        assert abs(first - generic["loss (step 0)"]) < 1e-4 * first
    hf, ours = pairs[3]
    assert ours["syncs/step"] == 0 and ours["tokens/s"] > 0 and hf["tokens/s"] > 0
    assert hf["computed/step"] >= ours["tokens/step"] == hf["tokens/step"]
    assert abs(hf["loss (step 0)"] - ours["loss (step 0)"]) < 1e-4 * hf["loss (step 0)"]


@pytest.mark.slow
def test_kto_reward_quick(capsys):
    """Both sides train on the same tokens from the same start (the first step's loss agrees:
    KTO 0.5 with the reference = policy, reward log 2 + the same head); TRL pads, we do not
    (~2 min of CPU on 1 thread: TRL's KTO step is the slow part)."""
    rows = bench_kto_reward.main(["--quick"])
    table_header(capsys.readouterr().out, bench_kto_reward.COLUMNS)
    assert [r["objective"] for r in rows] == ["kto", "reward"]
    for row in rows:
        assert row["same loss (step 1)"] is True, row
        assert row["padded tokens (TRL)"] >= row["real tokens/step"] > 0
        assert row["TRL tok/s"] > 0 and row["ours tok/s"] > 0


def test_eval_quick(capsys):
    """slipstream eval's LM and lm-eval's HFLM (batch 1 and 16) on the same requests: the
    same answers, both timed."""
    pytest.importorskip("lm_eval")
    rows = bench_eval.main(["--quick", "--reps", "1"])
    table_header(capsys.readouterr().out, bench_eval.COLUMNS)
    assert [(r["task"], r["LM"]) for r in rows] == [
        (t, lm) for t in ("bench_mc", "bench_ppl") for lm in ("ours", "HFLM", "HFLM")
    ]
    assert all(r["requests/s"] > 0 and r["max |Δ log-lik|"] < 1e-2 for r in rows)


@pytest.mark.slow  # ~20 s
def test_peers_quick(tmp_path, capsys):
    """bench_peers end to end for slipstream alone (the peers need their own venvs) in bf16
    (one worker process: ~13 s of CPU; float32 is the same code with the other dtype): the
    data check against apply_chat_template, the worker, the table's row."""
    out = tmp_path / "p.json"
    argv = ["--quick", "--tools", "slipstream", "--dtypes", "bfloat16", "--work", str(tmp_path)]
    rows = bench_peers.main([*argv, "--json", str(out)])
    table_header(capsys.readouterr().out, bench_peers.COLUMNS)
    [row] = rows
    assert (row["dtype"], row["rounds"], row["vs slipstream"]) == ("bfloat16", 1, "1.00x")
    assert row["tokens/s"] > 0 and row["peak RSS GB"] > 0.1 and row["MFU"].endswith("%")
    assert 0.5 * bench_peers.TOKENS_PER_BATCH < row["tokens/step"] <= bench_peers.TOKENS_PER_BATCH
    info = json.loads(out.read_text())["info"]
    assert info["rows"] == 24 and 0 < info["labelled"] < info["tokens"]
    assert info["peaks_gflops"]["bfloat16"]["peak"] > 0
