"""Models of a named layout with random weights for `python -m benchmarks hf --model-layout`: a model of a size no
benchmark resource ships, built over the tokenizer of a model that is at hand, and saved as a user's directory.

The weights are transformers' own initialisation, seeded: the bench times training steps, and a step's work does
not depend on the weights' values. The vocabulary is the tokenizer's, so its ids all have rows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Layouts by name: BertConfig's fields (bert-base: BERT-base's, about 109M parameters over a 30522-word vocabulary).
LAYOUTS: dict[str, dict[str, int]] = {
    "bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
}


def layout_config(layout: str, tokenizer: Any) -> Any:
    """The BertConfig of a layout over a tokenizer's vocabulary."""
    from transformers import BertConfig

    return BertConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **LAYOUTS[layout])


def layout_dir(layout: str, tokenizer_dir: Path, out: Path, seed: int = 0) -> Path:
    """A BERT model of the layout with random weights (seeded), saved with the tokenizer of tokenizer_dir
    (save_pretrained both) into out: a model directory as a user's is, which both sides of the bench load."""
    import torch
    from transformers import AutoTokenizer, BertModel

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    model = BertModel(layout_config(layout, tokenizer))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("%s: a %s model, %d parameters, random weights (seed %d)", out, layout, parameters(model), seed)
    return out


def parameters(model: Any) -> int:
    """The model's parameters, counted."""
    return sum(p.numel() for p in model.parameters())
