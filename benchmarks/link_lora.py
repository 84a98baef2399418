"""The base of the link bench's LoRA model (`hflora`): a Llama-style causal LM of random weights built from a
transformers config, and a byte-level BPE tokenizer trained here on the text it will read, saved with
save_pretrained as a user's model directory (no model hub is reached).

The directory is built once and reused while its recipe (recipe.json: the layout, the seed and a digest of the
tokenizer's text) is the same. It is written beside its place and moved there whole, so a directory at that place
is always complete.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

RECIPE_FILE = "recipe.json"
SPECIAL_TOKENS = ("<pad>", "<unk>", "<eos>")


@dataclass(frozen=True)
class Layout:
    """A Llama-style decoder: the defaults are 110M parameters (12 layers of hidden 768, SwiGLU 2048, an untied
    head over a vocabulary of 16384)."""

    hidden: int = 768
    layers: int = 12
    heads: int = 12
    intermediate: int = 2048
    vocab: int = 16384
    positions: int = 512

    def parameters(self) -> int:
        """Its parameter count: per layer the four attention projections, the three of the MLP and two norms; the
        embedding, the untied head and the final norm."""
        h = self.hidden
        layer = 4 * h * h + 3 * h * self.intermediate + 2 * h
        return self.layers * layer + 2 * self.vocab * h + h


def lora_parameters(layout: Layout, rank: int, targets: Sequence[str] = ("q_proj", "v_proj")) -> int:
    """LoRA's trainable parameters on a Layout: each targeted projection of each layer gets A (rank x its input) and
    B (its output x rank). Every projection named here maps hidden to hidden (the heads' width is the hidden's)."""
    square = {"q_proj", "k_proj", "v_proj", "o_proj"}
    unknown = set(targets) - square
    if unknown:
        raise ValueError(f"lora_parameters counts the attention's projections only, not {sorted(unknown)}")
    return layout.layers * len(targets) * 2 * rank * layout.hidden


def model_sizes(model: nn.Module) -> dict[str, int]:
    """Its parameters, those that train, and the bytes of those: what a sync sums each step (exact), or once a round
    (local's deltas); raytrm.sync.strategy counts the same."""
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    return {
        "parameters": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in trained),
        "sync_bytes": sum(p.numel() * p.element_size() for p in trained),
    }


def record_texts(records: Path, field: str = "text") -> list[str]:
    """The texts of a records CSV (benchmarks.hf_corpus' records.csv), in file order."""
    with records.open(newline="", encoding="utf-8") as f:
        return [row[field] for row in csv.DictReader(f)]


def _tokenizer(texts: Sequence[str], vocab: int) -> object:
    """A byte-level BPE of `vocab` tokens (fewer where the texts hold fewer merges) with pad, unk and eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # every byte has a token: no text is unknown
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=alphabet)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def base_dir(root: Path, texts: Sequence[str], layout: Layout = Layout(), seed: int = 0) -> Path:
    """The model directory at root (config.json, the weights, the tokenizer), built unless root holds one of the
    same recipe."""
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()[:16]
    recipe = {"layout": asdict(layout), "seed": seed, "texts": digest}
    stored = root / RECIPE_FILE
    if stored.is_file() and json.loads(stored.read_text()) == recipe:
        logger.info("hflora base: %s, built before with this recipe", root)
        return root
    from transformers import LlamaConfig, LlamaForCausalLM

    from raytrm.families.hf_model import quietly

    tokenizer = _tokenizer(texts, layout.vocab)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=layout.hidden,
        intermediate_size=layout.intermediate,
        num_hidden_layers=layout.layers,
        num_attention_heads=layout.heads,
        num_key_value_heads=layout.heads,
        max_position_embeddings=layout.positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with quietly():  # transformers' progress bars, in the bench's log
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
    (partial / RECIPE_FILE).write_text(json.dumps(recipe, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    partial.rename(root)
    logger.info("hflora base: %s, %s parameters, vocabulary %d", root, f"{model.num_parameters():,}", len(tokenizer))
    return root
