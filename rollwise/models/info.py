"""Size facts about a loaded model, for FLOP and memory estimates."""

from __future__ import annotations

import torch


def model_info(model: torch.nn.Module) -> dict:
    """Parameter counts and shape facts of a causal LM.

    Tied weights are counted once. `params_embedding` counts the input and output embeddings (once when tied);
    `params_matmul` is what a forward pass multiplies per token: every non-embedding parameter plus the output
    projection (vocab x hidden, tied or not). Forward FLOPs per token ~= 2 * params_matmul, plus attention.
    """
    cfg = model.config.get_text_config()
    total = sum(p.numel() for p in model.parameters())
    embedding_params = {}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is not None:
            embedding_params.update({id(p): p for p in module.parameters()})
    embedding = sum(p.numel() for p in embedding_params.values())
    output = model.get_output_embeddings()
    head = output.weight.numel() if output is not None else 0
    return {
        "params_total": total,
        "params_embedding": embedding,
        "params_non_embedding": total - embedding,
        "params_matmul": total - embedding + head,
        "layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": getattr(cfg, "intermediate_size", None),
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
    }
