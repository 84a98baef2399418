"""Tiny Hugging Face models saved as a user's local directories, offline: a BERT-style classifier and a GPT-2-style
language model, each with a tokenizer trained here on the words it will see (no model hub is reached)."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np

#: Words the tiny tokenizers learn, and the texts of the tests' records are made of.
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "ran",
    "far",
    "away",
    "while",
    "a",
    "red",
    "dog",
    "slept",
    "under",
    "the",
    "warm",
    "sun",
    "near",
    "the",
    "river",
    "bank",
    "every",
    "morning",
    "birds",
    "sing",
    "songs",
    "about",
    "green",
    "trees",
    "tall",
    "hills",
    "quiet",
    "lakes",
    "and",
    "bright",
    "stars",
]


def _train_tokenizer(kind: str, corpus: Sequence[str]) -> object:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        tok.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=200, special_tokens=special))
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
        )
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        special = ["<pad>", "<unk>", "<eos>"]
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=special))
    return tok


def classifier_dir(root: Path, labels: Sequence[str] = ("neg", "pos"), seed: int = 0) -> Path:
    """A BERT-style sequence classifier (2 layers, hidden 32) and its WordPiece tokenizer, saved in root."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer("wordpiece", corpus),
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)},
        pad_token_id=tokenizer.pad_token_id,
    )
    model = BertForSequenceClassification(config)
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def causal_lm_dir(root: Path, seed: int = 0) -> Path:
    """A GPT-2-style causal language model (2 layers, hidden 32) and its byte-level BPE tokenizer, saved in root."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer("bpe", corpus), unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=128,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = GPT2LMHeadModel(config)
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def write_records(path, count=96, seed=0, labelled=True):
    """Records of two text fields whose label shows in the body: "pos" bodies are made of the first half of the
    tiny tokenizer's words, "neg" bodies of the second, of varied lengths."""
    rng = np.random.default_rng(seed)
    half = len(WORDS) // 2
    rows = []
    for i in range(count):
        label = "pos" if i % 2 == 0 else "neg"
        pool = WORDS[:half] if label == "pos" else WORDS[half:]
        body = " ".join(rng.choice(pool, int(rng.integers(3, 30))))
        subject = " ".join(rng.choice(WORDS, int(rng.integers(1, 4))))
        rows.append({"subject": subject, "body": body, **({"label": label} if labelled else {})})
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def text_records(path, count, longest=30, seed=0):
    """The hf benches' records.csv in little: a text field of 2 to `longest` of the tiny tokenizer's words and a
    label field, "neg" and "pos" in turn."""
    rng = np.random.default_rng(seed)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for i in range(count):
            writer.writerow([" ".join(rng.choice(WORDS, size=int(rng.integers(2, longest)))), ("neg", "pos")[i % 2]])
    return path
