"""The user's own transformers model: its tokenizer, the model built for a task (whole, or with LoRA through peft), and
the model directory a run leaves behind.

transformers and peft are an optional extra (raytrm[hf]): every import of them is inside a function, after
`prepare_environment`, so the core package never needs them and macOS gets the settings users otherwise set by hand.
Each thing a user can give wrong (a path that does not exist, a directory without a tokenizer, a model class the
task cannot serve, LoRA targets the model does not have) is one line naming the path, the field, what was found,
what was expected and the fix.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import shutil
import sys
from collections.abc import Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from raytrm import config as cfg
from raytrm.errors import ConfigError, UserError

logger = logging.getLogger(__name__)

#: Where a run keeps its model for transformers (RUN_DIR/model), written at the run's end.
MODEL_DIR = "model"

#: What users of transformers on a Mac set by hand: ops MPS lacks run on the CPU instead of failing, and the
#: tokenizers' threads stay off where a process may fork (their warning, and a possible deadlock, otherwise).
MAC_ENVIRONMENT = {"PYTORCH_ENABLE_MPS_FALLBACK": "1", "TOKENIZERS_PARALLELISM": "false"}

#: Files of which a directory's tokenizer is made (any one of them); AutoTokenizer would otherwise build one of
#: special tokens alone from a directory that has none, and training would see every word as unknown.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)

#: A name the hub could hold ("name" or "owner/name"), as opposed to a path on this machine.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def prepare_environment(
    platform: str = sys.platform, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """On macOS, set MAC_ENVIRONMENT's variables where the user has not (before transformers is imported, which
    reads them); returns those set."""
    environ = os.environ if environ is None else environ
    if platform != "darwin":
        return {}
    chosen = {key: value for key, value in MAC_ENVIRONMENT.items() if key not in environ}
    environ.update(chosen)
    return chosen


def require_libraries() -> None:
    """transformers and peft importable, else one line naming the extra to install."""
    prepare_environment()
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise UserError(
            f"model.name hf needs the Hugging Face libraries, and {e.name or 'one of them'} is not installed; "
            'fix: pip install "raytrm[hf]"'
        ) from None


def locate(path: str) -> Path | str:
    """model.path as a local directory (checked to hold a model), or as a hub name left to transformers (which
    respects HF_HUB_OFFLINE)."""
    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir() or not (local / "config.json").is_file():
            found = "a file" if not local.is_dir() else f"a directory of {_listing(local)}"
            raise ConfigError(
                str(local),
                "model.path",
                found,
                "a model directory with its config.json (as save_pretrained writes one)",
                "give the directory that model.save_pretrained(DIR) wrote",
            )
        return local
    if _HUB_NAME.fullmatch(path) and not path.startswith("."):
        return path
    raise ConfigError(
        path,
        "model.path",
        "no such directory",
        "a model directory on this machine, or a hub name (owner/name)",
        "check the path (--model-path DIR)",
    )


def _listing(directory: Path, shown: int = 6) -> str:
    names = sorted(p.name for p in directory.iterdir())
    return (", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")) or "nothing"


def _from_hub(source: Path | str, error: Exception) -> UserError:
    """transformers' refusal to resolve a hub name, as one line."""
    why = " ".join(str(error).split())[:160]
    return UserError(
        f"{source}: model.path is not a directory here, and transformers could not fetch it as a hub name ({why}); "
        "fix: give a local directory (save_pretrained), or let this machine reach the hub (unset HF_HUB_OFFLINE)"
    )


def load_tokenizer(source: Path | str) -> Any:
    """The model's tokenizer (AutoTokenizer); a local directory without one is refused in one line."""
    require_libraries()
    from transformers import AutoTokenizer

    if isinstance(source, Path) and not any((source / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            str(source),
            "model.path",
            f"a directory of {_listing(source)}",
            f"a tokenizer beside the model (one of {', '.join(TOKENIZER_FILES[:3])}, ...)",
            "save it there too: tokenizer.save_pretrained(DIR)",
        )
    try:
        return AutoTokenizer.from_pretrained(source)
    except OSError as e:
        raise _from_hub(source, e) from None


def _served(source: Path | str, task: str) -> Any:
    """The directory's config, once its model type has a class for the task (AutoConfig's refusal as one line)."""
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    try:
        config = AutoConfig.from_pretrained(source)
    except OSError as e:
        raise _from_hub(source, e) from None
    except (ValueError, KeyError) as e:
        raise ConfigError(
            str(source),
            "model.path",
            f"a config.json transformers does not read ({e})",
            "a transformers model's config",
            "check config.json there (its model_type)",
        ) from None
    classes = (
        modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
        if task == "classify"
        else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
    if config.model_type not in classes:
        kind = "a sequence classifier" if task == "classify" else "a causal language model"
        named = ", ".join(getattr(config, "architectures", None) or []) or "none named"
        raise ConfigError(
            str(source),
            "model.task",
            f"{task}, for a {config.model_type} model",
            f"a model type transformers builds as {kind} (this one's architectures: {named})",
            "pick the other task (model.task), or a model of a type that has that class",
        )
    return config


def _positions(config: Any) -> int | None:
    """The most positions the model embeds, where its config says."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@contextlib.contextmanager
def quietly() -> Iterator[None]:
    """transformers' own load report and progress bars off while it loads or saves a model: raytrm says in its own
    lines what matters there (a new classifier head, where the model was written). raytrm's log level DEBUG keeps
    them."""
    from transformers.utils import logging as hf_logging

    if logger.isEnabledFor(logging.DEBUG):
        yield
        return
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def build_model(model: cfg.ModelConfig, label_names: Sequence[str], pad_id: int | None) -> nn.Module:
    """The model of model.path for model.task, with fp32 weights (the forward's dtype is the Trainer's), seeded by
    the caller; a classifier's head has one output per label name, a new head where the directory's has another
    size. With model.lora_rank, LoRA's adapters wrap it (`apply_lora`)."""
    require_libraries()
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    source = locate(str(model.path))
    config = _served(source, model.task)
    positions = _positions(config)
    if positions is not None and model.seq_len > positions:
        raise ConfigError(
            str(source),
            "model.seq_len",
            model.seq_len,
            f"at most the {positions} positions the model embeds",
            f"set model.seq_len <= {positions}",
        )
    if model.task == "classify":
        names = list(label_names)
        labels = {"id2label": dict(enumerate(names)), "label2id": {name: i for i, name in enumerate(names)}}
        other_head = config.num_labels != len(names)
        if other_head:
            logger.info(
                "%s: its classifier head has %d outputs, the data %d labels (%s): a new head is initialised for them",
                source,
                config.num_labels,
                len(names),
                ", ".join(names),
            )
        with quietly():
            built = AutoModelForSequenceClassification.from_pretrained(
                source, **labels, ignore_mismatched_sizes=other_head, dtype=torch.float32
            )
        if built.config.pad_token_id is None:  # a decoder's classifier reads the last token that is not padding
            built.config.pad_token_id = pad_id
    else:
        with quietly():
            built = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        if not _causal(built):
            raise ConfigError(
                str(source),
                "model.task",
                f"lm, for a bidirectional {config.model_type} model",
                "a causal language model (a decoder: each token's output sees only the tokens before it)",
                "train it as a classifier (model.task: classify), or give a causal language model",
            )
    built.train()
    return apply_lora(built, model) if model.lora_rank is not None else built


@torch.no_grad()
def _causal(model: nn.Module) -> bool:
    """Whether the model's outputs at a position ignore later tokens: two sequences that differ in their last token
    only must agree before it."""
    vocab = int(model.config.vocab_size)
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5]]) % vocab
    was = model.training
    model.eval()
    logits = model(input_ids=ids).logits
    model.train(was)
    return torch.allclose(logits[0, :3], logits[1, :3], rtol=1e-4, atol=1e-5)


def _projection_names(model: nn.Module) -> list[str]:
    """The short names of the model's linear layers: what lora_targets may name."""
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if name and (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D")
    }
    return sorted(names)


def apply_lora(model: nn.Module, settings: cfg.ModelConfig) -> nn.Module:
    """LoRA's adapters (peft) on the model: only they, and a classifier's head, train. Their B starts at zero, so the
    wrapped model's first forward is the model's own."""
    from peft import LoraConfig, TaskType, get_peft_model

    lora = LoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        target_modules=list(settings.lora_targets) if settings.lora_targets else None,
        task_type=TaskType.SEQ_CLS if settings.task == "classify" else TaskType.CAUSAL_LM,
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as e:  # peft's own targets unknown for the architecture, or named targets not in the model
        found = settings.lora_targets or "peft's default for this architecture (none known)"
        shown = ", ".join(_projection_names(model)[:12])
        raise ConfigError(
            str(settings.path),
            "model.lora_targets",
            found,
            f"names of the model's linear layers ({shown})",
            f"set model.lora_targets to the attention's projections among them ({' '.join(str(e).split())[:80]})",
        ) from None


def is_lora(model: nn.Module) -> bool:
    """Whether the model is wrapped by peft."""
    return hasattr(model, "merge_and_unload") and hasattr(model, "peft_config")


def join_fields(texts: Sequence[str], tokenizer: Any) -> str:
    """A record's texts as one, joined with the tokenizer's separator (its sep token, else its end of sequence)."""
    if len(texts) == 1:
        return texts[0]
    sep = tokenizer.sep_token or tokenizer.eos_token or "\n"
    return f" {sep} ".join(texts)


def save_model_dir(model: nn.Module, tokenizer: Any, out: Path, merge: bool = True) -> Path:
    """Write the model as transformers loads it (save_pretrained): its weights (LoRA's adapters merged into them
    with merge, else the adapters alone), its config with the label names, and the tokenizer. Written beside `out`
    and moved there whole, so a directory at `out` is always complete."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    merged = is_lora(model) and merge
    if merged:
        # On a copy: the run's model keeps its adapters (the EMA's weights are swapped back into it afterwards).
        model = copy.deepcopy(model).merge_and_unload()
    with quietly():
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    logger.info("model written to %s%s", out, " (LoRA merged into the weights)" if merged else "")
    return out
