"""Sequence parallelism (`train.sequence_parallel`, ops/ulysses.py, sequence_parallel.py) on CPU:
2 gloo ranks under torchrun, float32.

Checks: the host split of a packed batch (pieces, positions, balance); one training step split
over 2 ranks gives the whole batch's loss and gradients (dense GQA, GPT-OSS sinks + window +
MoE, Gemma 3 local/global; generic OLMo 2 and Mixtral through transformers' modeling code; a
sequence longer than a rank's share; recompute on) with about half the activation memory a
rank; a 2-rank `slipstream train` run (native; generic OLMo 2, slow) logs the losses and saves
the adapter of one process; settings the split cannot serve (generic layers run per sequence
among them) are one-line errors.
"""

import json
from pathlib import Path

import pytest
import torch
from helpers.models import make_hf_model
from helpers.runs import chat_rows, losses
from helpers.tiny_hf import quiet as quiet  # noqa: F401 (module fixture)
from helpers.tiny_hf import save_tiny, tiny_config
from helpers.tokenizers import save_test_tokenizer
from helpers.torchrun import check, run_torchrun, train_job
from safetensors.torch import load_file

from slipstream.config import config_from_dict
from slipstream.ops.packing import SeqInfo
from slipstream.ops.ulysses import shard_seq, split_lengths
from slipstream.train import train

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("lengths, ranks", [([37, 5, 190, 13, 3], 2), ([1, 2, 9], 4), ([7], 3)])
def test_split_cuts_the_stream_into_balanced_contiguous_shards(lengths, ranks):
    shards = split_lengths(lengths, ranks)
    sizes = [sum(p) for p, _ in shards]
    assert sum(sizes) == sum(lengths) and max(sizes) - min(sizes) <= 1
    whole = SeqInfo.from_lengths(lengths)
    local = [shard_seq(whole, r, ranks, None) for r in range(ranks)]
    # Each token keeps its position in its own sequence; the slices tile the stream in order.
    positions = torch.cat([s.position_ids for s, _ in local])
    assert torch.equal(positions, whole.position_ids)
    assert [part.start for _, part in local] == [sum(sizes[:r]) for r in range(ranks)]
    assert all(s.shard.full is whole and s.shard.sizes == tuple(sizes) for s, _ in local)


def test_split_refuses_fewer_tokens_than_ranks():
    with pytest.raises(ValueError, match="3 tokens cannot be split over train.sequence_parallel=4"):
        split_lengths([1, 2], 4)


@pytest.mark.parametrize("models", [
    ("llama", "gpt_oss", "gemma3_text"),
    pytest.param(("olmo2", "mixtral"), marks=pytest.mark.slow),  # the generic family
])  # fmt: skip
def test_two_ranks_step_equals_the_whole_batch(tmp_path, models):
    # As a module of tests/: the script's own folder on sys.path would shadow `tokenizers`
    # (helpers/tokenizers.py) when transformers imports it for the generic models.
    script = ["-m", "helpers.sequence_parallel_step", str(tmp_path), *models]
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    check(run_torchrun(script, tmp_path, timeout=120, env=env))
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert tuple(ranks[0]) == models
    for model_type, r0 in ranks[0].items():
        r1 = ranks[1][model_type]
        # The 190-token sequence is cut: rank 1's first piece starts at position 82.
        assert r0["tokens"] == r1["tokens"] == 124 and r1["starts"][0] == 82, (r0, r1)
        assert r0["labels"] == r0["want_labels"]
        for r in (r0, r1):
            assert r["loss"] == pytest.approx(r["want_loss"], rel=1e-6), model_type
            assert r["grad_rel_err"] < 1e-5, (model_type, r["grad_rel_err"])
            # Activations (live tensors above the weights) about halve: 0.52-0.61 measured.
            assert r["shard_peak"] < 0.7 * r["whole_peak"], (model_type, r)


def long_rows(n: int) -> list[dict]:
    """Chat rows of ~50-100 tokens, most longer than a rank's share of a 128-token batch."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"]
    return [{"messages": [
        {"role": "user", "content": " ".join(words[: 3 + i % 5])},
        {"role": "assistant", "content": " ".join(words * (1 + i % 2))},
    ]} for i in range(n)]  # fmt: skip


@pytest.fixture(scope="module")
def sp_data(tiny_run, tmp_path_factory):  # noqa: F811
    data = tmp_path_factory.mktemp("sp") / "train.jsonl"
    rows = chat_rows(24) + long_rows(8)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tiny_run[0], data


def sp_config(sp_data, out, **train):
    model_dir, data = sp_data
    return {
        "model": {"path": str(model_dir)},
        "data": {"train": str(data), "eval_fraction": 0.125},
        "lora": {"rank": 4, "alpha": 8},
        "train": {
            "lr": 2e-2, "steps": 4, "tokens_per_batch": 128, "grad_accum": 2, "warmup_steps": 1,
            "log_every": 1, "device": "cpu", "dist_timeout_s": 60, **train,
        },
        "output_dir": str(out),
    }  # fmt: skip


@pytest.mark.parametrize(
    "parallel", [pytest.param(p, marks=pytest.mark.slow) for p in ("ddp", "fsdp")]
)
def test_two_rank_sequence_parallel_run_matches_one_process(sp_data, tmp_path, parallel):
    """DDP, and FSDP2 (each decoder layer sharded over both ranks, the 2-D mesh's one data
    group), with the micro-batches split by sequence: one process's run."""
    single, multi = tmp_path / "single", tmp_path / "sp"
    train(config_from_dict(sp_config(sp_data, single)))
    check(train_job(sp_config(sp_data, multi, sequence_parallel=2, parallel=parallel), tmp_path))
    assert_same_run(single, multi)


@pytest.fixture(scope="module")
def olmo2_sp_data(sp_data, tmp_path_factory, quiet):
    """(model folder, the same train.jsonl): a tiny OLMo 2, the generic family (transformers'
    modeling code: no native family), with a chat tokenizer."""
    model_dir = tmp_path_factory.mktemp("olmo2") / "model"
    save_test_tokenizer(model_dir, "chatml", vocab_size=300)
    save_tiny(model_dir, "olmo2", vocab_size=300)
    return model_dir, sp_data[1]


@pytest.mark.slow
def test_two_rank_sequence_parallel_run_of_a_generic_model_matches_one_process(
    olmo2_sp_data, tmp_path
):
    """OLMo 2 through transformers' modeling code: our attention function does the shard's
    all-to-alls, RoPE gets each token's position in its own sequence."""
    single, multi = tmp_path / "single", tmp_path / "sp"
    train(config_from_dict(sp_config(olmo2_sp_data, single)))
    check(train_job(sp_config(olmo2_sp_data, multi, sequence_parallel=2), tmp_path))
    assert_same_run(single, multi)


def assert_same_run(single: Path, multi: Path) -> None:
    """The sequence-parallel run in `multi` logged and saved what one process did in `single`."""
    la, lb = losses(single), losses(multi)
    assert sorted(lb) == [1, 2, 3, 4]
    for step in la:
        assert abs(la[step] - lb[step]) < 1e-5, (step, la[step], lb[step])
    lines = [json.loads(x) for x in (multi / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (single / "metrics.jsonl").read_text().splitlines()]
    for key in ("grad_norm", "eval_loss"):  # the gradient's scale; eval split the same way
        got = [r[key] for r in lines if key in r]
        assert got == pytest.approx([r[key] for r in want if key in r], rel=1e-4), key
    summary = json.loads((multi / "summary.json").read_text())
    assert (
        summary["tokens_trained"]
        == json.loads((single / "summary.json").read_text())["tokens_trained"]
    )
    ta, tb = (load_file(p / "adapter_model.safetensors") for p in (single, multi))
    assert ta.keys() == tb.keys() and len(ta) > 0
    for name in ta:
        torch.testing.assert_close(ta[name], tb[name], atol=2e-5, rtol=1e-4)


def test_one_process_with_sequence_parallel_is_a_one_line_error(sp_data, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"^train.sequence_parallel=2 needs torchrun with a "
                       r"multiple of 2 processes; this run has 1$"):  # fmt: skip
        train(config_from_dict(sp_config(sp_data, out, sequence_parallel=2)))
    assert not out.exists() or not any(out.iterdir())


def test_config_refuses_a_zero_split(sp_data, tmp_path):
    with pytest.raises(ValueError, match="sequence_parallel"):
        config_from_dict(sp_config(sp_data, tmp_path, sequence_parallel=0))


def _native(model_type="llama", **overrides):
    from slipstream.models import family_for

    hf = make_hf_model(model_type, **overrides).config.to_dict()
    family = family_for(model_type, "test")
    return family.build(family.config_from_hf({**hf, "model_type": model_type}))


def test_models_the_split_cannot_serve_are_one_line_errors():
    from slipstream.objectives.preference import pair_objective
    from slipstream.sequence_parallel import check_model, check_objective

    model = _native()  # 6 query heads, 2 key/value heads
    check_model(model, 2)
    with pytest.raises(ValueError, match=r"=4 must divide the attention heads \(6 query, 2 key"):
        check_model(model, 4)
    with pytest.raises(ValueError, match="=3 must divide .* use a divisor of 2"):
        check_model(model, 3)
    from slipstream.models import family_for

    family = family_for("qwen3_5_text", "test")
    hf = {**tiny_config("qwen3_5_text", layers=4).to_dict(), "model_type": "qwen3_5_text"}
    hybrid = family.build(family.config_from_hf(hf))
    with pytest.raises(ValueError, match=r"2 layers of qwen3_5_text \(GatedDeltaNet, first "
                       r"layer 0\) carry a state .* splits attention layers only$"):  # fmt: skip
        check_model(hybrid, 2)
    with pytest.raises(ValueError, match="supports train.objective=sft .*; dpo"):
        check_objective(pair_objective("dpo"), 2)
    with pytest.raises(ValueError) as e:
        check_model(_native(), 4)
    assert "\n" not in str(e.value)


def _generic(model_type: str, **overrides):
    from slipstream.models import generic

    hf = {**tiny_config(model_type, **overrides).to_dict(), "model_type": model_type}
    return generic.build(generic.config_from_hf(hf))


def test_generic_models_the_split_cannot_serve_are_one_line_errors(quiet):
    """Through transformers' modeling code: softmax attention only is split (4 query, 2 kv
    heads here); a layer run once per sequence (Qwen3-Next's Gated DeltaNet, LFM2's short
    convolution, Falcon-H1's Mamba) or a RoPE that reads the longest position is refused."""
    from slipstream.sequence_parallel import check_model

    check_model(_generic("olmo2"), 2)
    with pytest.raises(ValueError, match=r"=4 must divide .*\(4 query, 2 key/value heads of olmo2"):
        check_model(_generic("olmo2"), 4)
    cases = {
        "qwen3_next": r"layers.0.linear_attn of qwen3_next \(Qwen3NextGatedDeltaNet; 1 such",
        "lfm2": r"layers.0.conv of lfm2 \(Lfm2ShortConv; 1 such",
        "falcon_h1": r"layers.0.mamba of falcon_h1 \(FalconH1Mixer; 2 such",
    }
    for model_type, first in cases.items():
        with pytest.raises(ValueError, match=rf"^train.sequence_parallel=2: {first} layers\) "
                           r"carries a state .* softmax attention layers only$"):  # fmt: skip
            check_model(_generic(model_type), 2)
    dynamic = _generic("olmo2", rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"^train.sequence_parallel=2: olmo2's RoPE \(dynamic\)"):
        check_model(dynamic, 2)


@pytest.mark.slow
def test_sequence_parallel_run_resumes_with_the_same_losses(sp_data, tmp_path):
    """A 2-rank sequence-parallel run's step-2 checkpoint, resumed under torchrun, logs the
    uninterrupted run's steps 3-4 and saves its adapter."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    raw = sp_config(sp_data, whole, sequence_parallel=2, save_every=2)
    check(train_job(raw, tmp_path))
    ckpt = whole / "checkpoints" / "step-000002"
    raw = {**sp_config(sp_data, resumed, sequence_parallel=2, save_every=2), "resume": str(ckpt)}
    check(train_job(raw, tmp_path))
    la, lb = losses(whole), losses(resumed)
    assert sorted(lb) == [3, 4]
    for step in lb:
        assert abs(la[step] - lb[step]) < 1e-6, (step, la[step], lb[step])
    ta, tb = (load_file(p / "adapter_model.safetensors") for p in (whole, resumed))
    for name in ta:
        torch.testing.assert_close(ta[name], tb[name], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_four_ranks_as_two_data_by_two_sequence_match_one_process(sp_data, tmp_path):
    """4 gloo ranks, DDP over 2 data-parallel groups of 2 sequence-parallel ranks (grad_accum
    2 each) = one process with grad_accum 4: the same losses, grad norms and adapter."""
    import time

    import yaml

    single, mesh = tmp_path / "single", tmp_path / "mesh"
    train(config_from_dict(sp_config(sp_data, single, grad_accum=4)))
    config = tmp_path / f"run-{time.monotonic_ns()}.yaml"
    config.write_text(yaml.safe_dump(sp_config(sp_data, mesh, sequence_parallel=2)))
    job = run_torchrun(["-m", "slipstream", "train", str(config)], tmp_path, timeout=400, nproc=4)
    check(job)
    assert "4 processes, parallel=ddp, sequence_parallel=2" in job.stderr
    la, lb = losses(single), losses(mesh)
    assert sorted(lb) == [1, 2, 3, 4]
    for step in la:
        assert abs(la[step] - lb[step]) < 1e-5, (step, la[step], lb[step])
    norms = [
        [json.loads(x).get("grad_norm") for x in (p / "metrics.jsonl").read_text().splitlines()]
        for p in (single, mesh)
    ]
    assert [n for n in norms[1] if n] == pytest.approx([n for n in norms[0] if n], rel=1e-4)
    ta, tb = (load_file(p / "adapter_model.safetensors") for p in (single, mesh))
    for name in ta:
        torch.testing.assert_close(ta[name], tb[name], atol=2e-5, rtol=1e-4)
