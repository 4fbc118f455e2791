"""The tokenizer the GGUF tests embed in their files: the chatml test BPE (tokenizers.py) sized
to the tiny models' vocabulary, as a module-scoped pytest fixture (import it by name)."""

from __future__ import annotations

import pytest

from tests.helpers.tokenizers import save_test_tokenizer

VOCAB = 320  # the test BPE: 256 bytes + specials + merges


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    import transformers

    folder = save_test_tokenizer(tmp_path_factory.mktemp("tok"), "chatml", vocab_size=VOCAB)
    return transformers.AutoTokenizer.from_pretrained(folder)
