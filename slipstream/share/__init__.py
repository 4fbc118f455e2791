"""Sharing a run on the Hugging Face Hub (`slipstream push`, `train.push_to_hub`): what goes
(files.py), the model card (card.py, from the base's facts in base.py), the upload and its
one-line errors (upload.py), the whole push (push.py), the command (command.py).

No torch import in any of them: torch comes in only for a merged model or a GGUF export.
"""
