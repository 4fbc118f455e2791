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


def image_text_class(config) -> type | None:
    """transformers' AutoModelForImageTextToText class for a config object, or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(type(config), None)


def builds_image_text(model_type: str | None) -> bool:
    """Whether transformers builds `model_type` as an image-text model (and no causal LM)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    return (
        model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
