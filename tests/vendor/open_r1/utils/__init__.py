# Vendored from huggingface/open-r1@1416fa0 (src/open_r1/utils/__init__.py), Apache License 2.0 (below or the repository's).
# Unchanged.
from .data import get_dataset
from .import_utils import is_e2b_available, is_morph_available
from .model_utils import get_model, get_tokenizer


__all__ = ["get_tokenizer", "is_e2b_available", "is_morph_available", "get_model", "get_dataset"]
