"""Checkpoint files: Hugging Face safetensors (hf.py), the tokenizer (tokenizer.py), PEFT
adapters (adapter.py), merged export (export.py), atomic writes (atomic.py); GGUF: each
family's spec (gguf_spec.py, gguf_families.py: architecture, what llama.cpp cannot run,
metadata both ways, layout changes with their inverses), in (gguf.py: HF tensors from a .gguf;
gguf_config.py: its config; gguf_fields.py: reading metadata) and out (gguf_export.py: the
merged model; gguf_arch.py: common keys and names; gguf_lora.py: a PEFT adapter as a GGUF
LoRA; gguf_modelfile.py: Ollama Modelfile).

Nothing is imported here: `slipstream.checkpoint.atomic` (which the CLI imports) must not pull
in torch."""
