"""Data-parallel training under torchrun on CPU: gloo, 2 processes, a tiny random Llama.

Checks: 2-rank DDP and 2-rank FSDP2 (grad_accum 2 each) log the same per-step losses and
save the same adapter as one process with grad_accum 4 (the same global batch); a sharded
(FSDP2) checkpoint resumed under torchrun continues with the same losses; resuming it with
another world size is a clear error; a malformed row in rank 1's share of the data stops the
job quickly with rank 1's message.
"""

import json
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
from helpers.planted import Planted
from helpers.runs import chat_rows, losses
from helpers.torchrun import check, free_port, run_torchrun, train_job
from safetensors.torch import load_file

from slipstream.config import config_from_dict
from slipstream.train import train
from slipstream.train.state import write_manifest

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6


def lora_config(tiny_run, out, **train):  # noqa: F811
    model_dir, data = tiny_run
    return {
        "model": {"path": str(model_dir)},
        "data": {"train": str(data), "eval_fraction": 0.125},
        "lora": {"rank": 4, "alpha": 8},
        "train": {
            "lr": 2e-2, "steps": STEPS, "tokens_per_batch": 128, "warmup_steps": 1,
            "log_every": 1, "save_every": 3, "device": "cpu", "dist_timeout_s": 60, **train,
        },
        "output_dir": str(out),
    }  # fmt: skip


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "adapter_model.safetensors")


def eval_losses(out: Path) -> list[float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_loss"] for r in lines if "eval_loss" in r]


def metrics(out: Path, key: str) -> dict[int, float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in lines if key in r}


def assert_same_run(a: Path, b: Path, steps=range(1, STEPS + 1)) -> None:
    la, lb = losses(a), losses(b)
    assert sorted(lb) == list(steps), lb
    for step in steps:
        assert abs(la[step] - lb[step]) < 1e-5, (step, la[step], lb[step])
    # Adam hides a wrong gradient scale from the losses (its update is nearly
    # scale-free); the gradient norm shows it: ranks must sum, not average.
    na, nb = metrics(a, "grad_norm"), metrics(b, "grad_norm")
    for step in steps:
        assert nb[step] == pytest.approx(na[step], rel=1e-4), (step, na[step], nb[step])
    ta, tb = adapter(a), adapter(b)
    assert ta.keys() == tb.keys() and len(ta) > 0
    for name in ta:
        torch.testing.assert_close(ta[name], tb[name], atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def runs(tiny_run, tmp_path_factory):  # noqa: F811
    """One process with grad_accum 4, then 2-rank DDP and FSDP2 with grad_accum 2 each."""
    tmp = tmp_path_factory.mktemp("dist")
    train(config_from_dict(lora_config(tiny_run, tmp / "single", grad_accum=4)))
    for mode in ("ddp", "fsdp"):
        raw = lora_config(tiny_run, tmp / mode, grad_accum=2, parallel=mode)
        check(train_job(raw, tmp))
    return tmp


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(runs, mode):
    single, multi = runs / "single", runs / mode
    assert_same_run(single, multi)
    # The eval loss (each rank evaluates its share, summed over ranks) moved the same way.
    ev_single, ev_multi = eval_losses(single), eval_losses(multi)
    assert len(ev_multi) == 2 and ev_multi[1] < ev_multi[0]
    assert ev_multi == pytest.approx(ev_single, abs=1e-5)
    summary = json.loads((multi / "summary.json").read_text())
    assert summary["status"] == "completed"
    done = json.loads((single / "summary.json").read_text())
    assert summary["tokens_trained"] == done["tokens_trained"]
    # Rank 0 alone wrote the metrics: one line per step, not two.
    lines = (multi / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == STEPS + 2


def test_fsdp_checkpoint_is_sharded_and_resumes(runs, tiny_run, tmp_path):  # noqa: F811
    ckpt = runs / "fsdp" / "checkpoints" / "step-000003"
    assert sorted(p.suffix for p in ckpt.iterdir() if p.suffix == ".distcp") == [".distcp"] * 2
    state = torch.load(ckpt / "state.pt", weights_only=False)
    assert state["world_size"] == 2 and len(state["rng"]) == 2 and "model" not in state
    out = tmp_path / "resumed"
    raw = {**lora_config(tiny_run, out, grad_accum=2, parallel="fsdp"), "resume": str(ckpt)}
    check(train_job(raw, tmp_path))
    assert_same_run(runs / "fsdp", out, steps=range(4, STEPS + 1))


@pytest.mark.slow  # ~15 s (torchrun); test_reliability refuses a planted pickle by default
def test_fsdp_resume_refuses_a_planted_metadata_pickle(runs, tiny_run, tmp_path):  # noqa: F811
    """`.metadata` is a pickle torch.distributed.checkpoint would load as is: a payload in a
    checkpoint someone shipped (manifest rewritten, so intact) is refused on every rank."""
    ckpt = tmp_path / "step-000003"
    shutil.copytree(runs / "fsdp" / "checkpoints" / "step-000003", ckpt)
    marker, file = tmp_path / "pwned", ckpt / ".metadata"
    metadata = pickle.loads(file.read_bytes())
    metadata.planner_data["note"] = Planted(marker)
    file.write_bytes(pickle.dumps(metadata))
    write_manifest(ckpt, 3)
    out = tmp_path / "resumed"
    raw = {**lora_config(tiny_run, out, grad_accum=2, parallel="fsdp"), "resume": str(ckpt)}
    result = train_job(raw, tmp_path)
    errors = [x for x in result.stderr.splitlines() if "slipstream: error:" in x]
    assert result.returncode != 0 and len(errors) == 2, result.stderr[-4000:]  # each rank
    assert f"refused {file}: " in errors[0] and "it was not run" in errors[0], errors
    for streams in result.rank_logs().values():
        assert "Traceback" not in streams["stderr"], result.report()
    assert "exitcode  : 2" in result.stderr, result.report()
    assert not marker.exists() and not (out / "metrics.jsonl").exists()


def test_resume_with_another_world_size_is_an_error(runs, tiny_run, tmp_path):  # noqa: F811
    ckpt = runs / "ddp" / "checkpoints" / "step-000003"
    raw = {**lora_config(tiny_run, tmp_path / "one", grad_accum=4), "resume": str(ckpt)}
    with pytest.raises(ValueError, match="written by 2 process.*this run has 1"):
        train(config_from_dict(raw))


@pytest.mark.slow  # ~21 s (torchrun)
def test_full_finetune_defaults_to_fsdp_and_exports_the_full_model(tiny_run, tmp_path):  # noqa: F811
    """parallel=auto shards a full fine-tune; rank 0 writes the gathered weights."""
    single, multi = tmp_path / "single", tmp_path / "multi"
    for out, accum in ((single, 4), (multi, 2)):
        raw = lora_config(tiny_run, out, grad_accum=accum, steps=3, lr=3e-3, save_every=0)
        raw["train"]["finetune"] = "full"
        if out == single:
            train(config_from_dict(raw))
        else:
            result = train_job(raw, tmp_path)
            check(result)
    assert "fsdp" in result.stderr  # the resolved mode is announced
    la, lb = losses(single), losses(multi)
    assert sorted(lb) == [1, 2, 3]
    for step in la:
        assert abs(la[step] - lb[step]) < 1e-5, (step, la[step], lb[step])
    wa, wb = load_file(single / "model.safetensors"), load_file(multi / "model.safetensors")
    assert wa.keys() == wb.keys() and len(wa) > 5
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=2e-5, rtol=1e-4)


def test_bad_row_on_one_rank_stops_the_job_with_its_message(tiny_run, tmp_path):  # noqa: F811
    """Rank 1 tokenizes the second half of the rows; its malformed row (strict mode) must
    bring both ranks down at once with rank 1's message, not leave rank 0 waiting."""
    rows = chat_rows(24) + [{"messages": [{"role": "user", "content": "no reply"}]}]
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = lora_config(tiny_run, tmp_path / "out", grad_accum=2)
    raw["data"] = {"train": str(data), "strict": True}
    start = time.monotonic()
    result = train_job(raw, tmp_path, timeout=90)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "rank 1 (train rows 12-24): data row 24" in result.stderr, result.stderr[-3000:]
    assert elapsed < 60
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()


EXTREMES_SCRIPT = """
import json, math, os, sys
import torch
import torch.distributed as tdist
from slipstream import distributed as dist
tdist.init_process_group("gloo")
r = tdist.get_rank()
values = [torch.tensor(r + 1.0), torch.tensor(r + 1.0), torch.tensor(math.inf if r else 5.0),
          torch.tensor(-(r + 1.0))]
got = dist.extremes_over_ranks(values, ["min", "max", "min", "max"]).tolist()
sums = dist.sum_over_ranks([torch.tensor(r + 1.0), 10], torch.device("cpu")).tolist()
open(os.path.join(sys.argv[1], f"rank-{r}.json"), "w").write(json.dumps([got, sums]))
tdist.destroy_process_group()
"""


def test_extremes_over_ranks_are_every_ranks_min_and_max(tmp_path):
    """`extremes_over_ranks` under 2 gloo ranks: a min from rank 0, a max from rank 1, a rank
    holding a min's identity (+inf: no value) and a negative max; sums beside them."""
    script = tmp_path / "extremes.py"
    script.write_text(EXTREMES_SCRIPT)
    check(run_torchrun([str(script), str(tmp_path)], tmp_path, timeout=120))
    for rank in (0, 1):
        got, sums = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert got == [1.0, 2.0, 5.0, -1.0] and sums == [3.0, 20.0]


@pytest.mark.parametrize("num_batches", [1, 2, 5, 6])
def test_eval_share_covers_each_batch_once_with_equal_forwards(num_batches):
    from slipstream.train.loop import eval_share

    world = 3
    shares = [eval_share(num_batches, r, world) for r in range(world)]
    assert len({len(s) for s in shares}) == 1  # the same number of forwards on every rank
    counted = sorted(i for s in shares for i, c in s if c)
    assert counted == list(range(num_batches))


def test_fsdp_hands_every_layer_the_callers_seqinfo(monkeypatch):
    """FSDP2 must not rebuild the SeqInfo per layer (its forward-input cast copies dataclasses):
    every layer gets the caller's object, so masks derived from it are built once per forward."""
    import torch.distributed as tdist
    from helpers.models import make_hf_model

    from slipstream import distributed as sdist
    from slipstream.models import family_for
    from slipstream.ops.packing import SeqInfo

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    hf = make_hf_model().config
    family = family_for("llama", "test")
    model = family.build(family.config_from_hf({**hf.to_dict(), "model_type": "llama"}))
    tdist.init_process_group("gloo", rank=0, world_size=1)
    try:
        sdist.wrap_model(model, "fsdp", torch.device("cpu"))
        seen = []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda m, args: seen.append(args[1]))
        seq = SeqInfo.from_lengths([3, 5])
        ids = torch.randint(0, 97, (8,))
        model.loss(ids, ids, seq, reduction="sum").backward()
    finally:
        tdist.destroy_process_group()
    assert len(seen) == len(model.model.layers) and all(s is seq for s in seen)


def test_fsdp_generates_on_gathered_weights_with_unequal_forwards(tiny_run, tmp_path):  # noqa: F811
    """`gathered_for_generation`: 2 FSDP2 ranks decode different numbers of tokens (rank 0
    one call of 3, rank 1 two calls of 19; a per-layer all-gather in each forward would
    deadlock), the first time before any root forward, and reply as the unsharded model;
    on exit the weights are sharded again (and the layers after a later forward), and a
    training forward and backward in between gives the unsharded loss and gradient."""
    model_dir, _ = tiny_run
    script = str(ROOT / "tests" / "helpers" / "fsdp_generation.py")
    check(run_torchrun([script, str(model_dir), str(tmp_path)], tmp_path, timeout=120))
    for rank, steps in ((0, 3), (1, 19)):
        r = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert [len(t) for t in r["want_tokens"][0]] == [steps, steps]
        assert r["first"] == r["want_tokens"] and r["second"] == r["want_tokens"]
        assert r["resharded"] and r["layers_resharded"]
        assert r["got_loss"] == pytest.approx(r["want_loss"], abs=1e-6)
        assert r["grad_max_diff"] < 1e-6
