"""bf16 on CPU and the thread count: `model.dtype: auto` detects the bf16 unit (AMX or
AVX512-BF16) and picks bf16 only with one; bf16 training keeps float32 LoRA factors, grads
and loss, and lands within bf16's tolerance of float32; threads default to physical cores.

The suite pins auto to float32 (conftest: SLIPSTREAM_CPU_BF16=0); these tests undo the pin
where they test the rule, and ask for bf16 explicitly where they test bf16 numerics, so they
run the same on a CPU without the unit (emulated, slower, equally exact).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import make_hf_model
from helpers.runs import run_config

from slipstream import cpu
from slipstream.checkpoint.hf import load_model
from slipstream.config import config_from_dict
from slipstream.device import choose_dtype
from slipstream.ops.packing import SeqInfo
from slipstream.peft.lora import apply_lora

# bf16 keeps 8 bits of mantissa (relative step 2**-8 = 0.4%). Measured on this tiny model:
# loss 0.02% apart, the worst LoRA grad at cosine 0.9989 and 1.0% off in norm; the bounds
# leave a few-fold margin. A lost float32 (factors or loss in bf16) fails the dtype asserts.
LOSS_RTOL = 5e-3
GRAD_COSINE_MIN = 0.99
GRAD_NORM_RTOL = 5e-2
# The held-out loss after a short run, bf16 against float32 (measured 0.005% apart).
EVAL_LOSS_RTOL = 1e-2


def test_bf16_unit_from_flags():
    assert cpu.bf16_unit_of({"avx512f", "amx_tile", "amx_bf16", "avx512_bf16"}) == "AMX-BF16"
    assert cpu.bf16_unit_of({"avx512f", "avx512_bf16"}) == "AVX512-BF16"
    assert cpu.bf16_unit_of({"avx512f", "avx2", "fma"}) is None  # AVX-512 alone emulates bf16
    assert cpu.bf16_unit_of(set()) is None


def test_cpuinfo_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu.cpuinfo_flags(str(info)) == {"fpu", "avx512f", "avx512_bf16"}
    assert cpu.cpuinfo_flags(str(tmp_path / "missing")) == set()


def test_auto_dtype_follows_the_unit(monkeypatch):
    cpu_dev = torch.device("cpu")
    monkeypatch.delenv(cpu.BF16_ENV)
    monkeypatch.setattr(cpu, "_torch_flags", lambda: {"avx512_bf16"})
    assert choose_dtype("auto", cpu_dev) == (torch.bfloat16, "auto: this CPU has AVX512-BF16")
    monkeypatch.setattr(cpu, "_torch_flags", lambda: set())
    dtype, why = choose_dtype("auto", cpu_dev)
    assert dtype == torch.float32 and "no native bf16" in why
    # A torch without the probe: /proc/cpuinfo's flags decide.
    monkeypatch.setattr(cpu, "_torch_flags", lambda: None)
    monkeypatch.setattr(cpu, "cpuinfo_flags", lambda: {"amx_bf16"})
    assert choose_dtype("auto", cpu_dev)[0] == torch.bfloat16
    monkeypatch.setenv(cpu.BF16_ENV, "0")  # the override wins over the flags
    assert choose_dtype("auto", cpu_dev)[0] == torch.float32
    assert choose_dtype("float32", cpu_dev) == (torch.float32, "model.dtype")
    assert choose_dtype("bfloat16", cpu_dev) == (torch.bfloat16, "model.dtype")
    assert choose_dtype("auto", torch.device("cuda"))[0] == torch.bfloat16


def test_torch_probe_agrees_with_cpuinfo():
    """Where the installed torch has the probe, it reads the same units as the kernel."""
    probed = cpu._torch_flags()
    if probed is None:
        pytest.skip("this torch has no torch.cpu._is_avx512_bf16_supported")
    flags = cpu.cpuinfo_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags here")
    assert cpu.bf16_unit_of(probed) == cpu.bf16_unit_of(flags)


def _cpuinfo(tmp_path, cores: int, threads_per_core: int):
    blocks = []
    for logical in range(cores * threads_per_core):
        core = logical % cores
        blocks.append(f"processor\t: {logical}\nphysical id\t: 0\ncore id\t\t: {core}\n")
    path = tmp_path / "cpuinfo"
    path.write_text("\n".join(blocks))
    return str(path)


def test_physical_cores(tmp_path, monkeypatch):
    path = _cpuinfo(tmp_path, cores=4, threads_per_core=2)  # 8 logical CPUs
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cpu.physical_cores(path) == 4
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0, 4, 1})  # 0 and 4 share
    assert cpu.physical_cores(path) == 2
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert cpu.physical_cores(str(tmp_path / "missing")) == 3  # no cpuinfo: the CPUs allowed


def test_threads_default_override_and_env(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu, "physical_cores", lambda: 2)
    try:
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        assert cpu.set_threads(None) == "2 threads (2 physical cores)"
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks share the two cores
        assert cpu.set_threads(None).startswith("1 thread (2 physical cores / 2 local")
        assert torch.get_num_threads() == 1
        assert cpu.set_threads(3) == "3 threads (train.threads)"
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torch read it at start: left as it is
        assert cpu.set_threads(None) == "3 threads (OMP_NUM_THREADS)"
        torch.set_num_threads(1)
        assert cpu.set_threads(None) == "1 thread (OMP_NUM_THREADS)"
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def _loss_and_grads(folder, dtype: torch.dtype):
    model = load_model(folder, dtype=dtype)
    torch.manual_seed(0)
    apply_lora(model, rank=4, alpha=8, targets="all-linear")
    with torch.no_grad():  # nonzero B: the A grads and the delta path are exercised too
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    lengths = [23, 9, 30]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 300, (sum(lengths),), generator=g)
    labels = torch.roll(ids, -1).clone()
    labels[torch.tensor(lengths).cumsum(0) - 1] = -100
    loss = model.loss(ids, labels, SeqInfo.from_lengths(lengths))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    factors = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    return loss, grads, factors


def test_bf16_loss_and_grads_match_float32(tmp_path):
    folder = tmp_path / "m"
    make_hf_model("llama", vocab_size=300, initializer_range=0.2).save_pretrained(folder)
    loss32, grads32, _ = _loss_and_grads(folder, torch.float32)
    loss16, grads16, factors = _loss_and_grads(folder, torch.bfloat16)
    # The precision rules: float32 factors (and so grads and AdamW states) and loss.
    assert loss16.dtype == torch.float32
    assert set(factors.values()) == {torch.float32}
    assert all(g.dtype == torch.float32 for g in grads16.values())
    rel = abs(loss16.item() - loss32.item()) / loss32.item()
    assert rel < LOSS_RTOL, f"loss {loss16.item()} vs {loss32.item()} ({rel:.2%})"
    for name, g32 in grads32.items():
        g16 = grads16[name]
        cos = torch.nn.functional.cosine_similarity(g16.flatten(), g32.flatten(), dim=0).item()
        norm = abs(g16.norm().item() - g32.norm().item()) / g32.norm().item()
        assert cos > GRAD_COSINE_MIN and norm < GRAD_NORM_RTOL, f"{name}: cos {cos}, {norm}"


def _train(tiny_run, out, dtype: str) -> dict:
    from slipstream.train import train

    raw = run_config(tiny_run, out, steps=8, eval_every=0)
    raw["model"]["dtype"] = dtype
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 8, "alpha": 16}
    summary = train(config_from_dict(raw))
    return summary


def test_bf16_run_lands_near_float32(tiny_run, tmp_path, capsys):
    """A short LoRA run (8 steps, held-out rows): bf16's held-out loss within EVAL_LOSS_RTOL
    of float32's, both having learned; the log says the dtype and why."""
    s32 = _train(tiny_run, tmp_path / "fp32", "float32")
    s16 = _train(tiny_run, tmp_path / "bf16", "bfloat16")
    log = capsys.readouterr()
    assert "dtype bfloat16 (model.dtype)" in log.out + log.err
    for s in (s32, s16):
        assert s["eval_loss_after"] < s["eval_loss_before"] - 0.1, s
    a, b = s32["eval_loss_after"], s16["eval_loss_after"]
    assert abs(a - b) / a < EVAL_LOSS_RTOL, f"held-out loss bf16 {b} vs float32 {a}"
    adapter = json.loads((tmp_path / "bf16" / "adapter_config.json").read_text())
    assert adapter["r"] == 8
