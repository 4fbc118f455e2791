"""Which model_types the generic family can build: the causal LMs transformers knows.

Asked only for a type with no native family (it imports transformers, ~2 s): the early
check before data or weights load, and the load itself.
"""

from __future__ import annotations


def transformers_builds(model_type: str | None) -> tuple[bool, str]:
    """(whether transformers builds `model_type` as a causal LM, its version)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, transformers.__version__
