"""The transformers + PEFT side of the GPU suite: the model with the best attention this image
has, whether packing through position_ids gives per-sequence results, its inputs, and the
row itself (`hf_row`: gradient checkpointing, peft LoRA on the same targets as ours)."""

from __future__ import annotations

from typing import Any

import common
import torch
from gpu_rows import LORA, OursCache, Setup, Variant, lora_targets, measure_steps


def hf_attentions(device: torch.device) -> list[str]:
    """transformers attention implementations to try, best first. Without flash_attn, flex
    on CUDA: with packed position_ids transformers' sdpa path builds a dense (T, T) mask, which
    rules out the flash kernel and computes every tile (~num_seqs x the causal work)."""
    best = []
    try:
        import flash_attn  # noqa: F401

        best = ["flash_attention_2"]
    except ImportError:
        pass
    if device.type == "cuda":
        best.append("flex_attention")
    return [*best, "sdpa", "eager"]


def build_hf(hf: dict, setup: Any) -> tuple[Any, str]:
    """The transformers model with the best attention it accepts, and that attention's name."""
    for attn in hf_attentions(setup.device):
        try:
            return build_hf_with(hf, setup, attn), attn
        except ValueError as e:  # "does not support an attention implementation through ..."
            error = e
    raise error


def build_hf_with(hf: dict, setup: Any, attn: str) -> Any:
    import transformers

    kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "transformers_version")}
    config = transformers.AutoConfig.for_model(hf["model_type"], **kwargs)
    config.use_cache = False
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(setup.dtype)
    try:
        with torch.device(setup.device):
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    finally:
        torch.set_default_dtype(old)


def hf_packing_ok(model: Any, setup: Any) -> bool:
    """Does this transformers build give per-sequence results for position_ids packing?"""
    lengths, vocab = [5, 7, 4], model.config.vocab_size
    ids = torch.randint(0, vocab, (sum(lengths),), device=setup.device)
    pos = torch.cat([torch.arange(n, device=setup.device) for n in lengths])
    with torch.no_grad():
        packed = model(input_ids=ids[None], position_ids=pos[None]).logits[0].float()
        parts = [model(input_ids=chunk[None]).logits[0].float() for chunk in ids.split(lengths)]
    # In bf16 on CPU (an emulation: no GPU has run this yet) packed-vs-split logits of
    # Qwen3-0.6B shapes differed by ~0.05, attention leaking across sequences by ~4.5.
    tol = 1e-3 if setup.dtype == torch.float32 else 0.5
    return torch.allclose(packed, torch.cat(parts), atol=tol, rtol=tol)


def hf_inputs(setup: Any, vocab: int, packed: bool) -> tuple[dict, int]:
    """transformers inputs for the same sequences: one packed row, or a padded batch."""
    ids, _, _ = common.random_batch(setup.lengths, vocab, "cpu")
    seqs = list(ids.split(setup.lengths))
    if packed:  # labels are shifted inside the model; -100 keeps them within each sequence
        labels = torch.cat([torch.cat([torch.tensor([-100]), s[1:]]) for s in seqs])
        pos = torch.cat([torch.arange(n) for n in setup.lengths])
        inputs = dict(input_ids=ids[None], position_ids=pos[None], labels=labels[None])
        computed = ids.numel()
    else:
        longest = max(setup.lengths)
        inputs = dict(
            input_ids=torch.zeros(len(seqs), longest, dtype=torch.long),
            attention_mask=torch.zeros(len(seqs), longest, dtype=torch.long),
            labels=torch.full((len(seqs), longest), -100),
        )
        for i, s in enumerate(seqs):
            inputs["input_ids"][i, : len(s)] = s
            inputs["attention_mask"][i, : len(s)] = 1
            inputs["labels"][i, : len(s)] = s
        computed = len(seqs) * longest
    return {k: t.to(setup.device) for k, t in inputs.items()}, computed


def hf_row(v: Variant, setup: Setup) -> dict:
    import peft

    OursCache.clear()  # weights of ours must not count in this row's peak memory
    hf = setup.shapes[v.model]
    model, attn = build_hf(hf, setup)
    packed = hf_packing_ok(model, setup)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = peft.LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                             target_modules=lora_targets(model), task_type="CAUSAL_LM")  # fmt: skip
    # peft's default: float32 adapters on the bf16 base, as ours (its adapter matmuls run in
    # float32, ours cast the factors to bf16).
    model = peft.get_peft_model(model, config).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=True)
    inputs, computed = hf_inputs(setup, hf["vocab_size"], packed)

    def step():
        model(**inputs).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # count_syncs' modes cannot wrap transformers' compiled flex call (dynamo refuses to run
    # compiled code under them); that row is audited by CUDA's sync-debug warnings alone.
    row = measure_steps(step, setup, audit=True, count=attn != "flex_attention")
    row.update(
        attention=attn,
        packing="packed (position_ids)" if packed else f"padded ({computed} tokens computed)",
        notes="gradient checkpointing, peft LoRA",
    )
    return row  # the model goes with this frame; run_row then frees the memory
