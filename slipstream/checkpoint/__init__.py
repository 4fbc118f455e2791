"""Checkpoint files: Hugging Face safetensors (hf.py), PEFT adapters (adapter.py), merged export
(export.py), atomic writes (atomic.py); GGUF in (gguf.py: HF tensors from a .gguf;
gguf_config.py: its config) and out (gguf_export.py: the merged model; gguf_arch.py: family ->
llama.cpp architecture, keys and layouts; gguf_lora.py: a PEFT adapter as a GGUF LoRA;
gguf_modelfile.py: Ollama Modelfile).

Nothing is imported here: `slipstream.checkpoint.atomic` (which the CLI imports) must not pull
in torch."""
