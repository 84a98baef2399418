"""The byte-level transformer: shapes, causality, pooling over real tokens, and gradient checkpointing."""

from __future__ import annotations

import pytest
import torch

from raytrm import config as cfg
from raytrm.models import Transformer


def model_config(**fields) -> cfg.ModelConfig:
    base = {"name": "transformer", "hidden_size": 32, "num_heads": 4, "layers": 2, "seq_len": 16}
    return cfg.from_dict(cfg.ModelConfig, {**base, **fields}, prefix="model")


def test_language_model_shapes_and_tied_head():
    torch.manual_seed(0)
    tied = Transformer(model_config())
    untied = Transformer(model_config(tie_embeddings=False))
    x = torch.randint(0, 256, (3, 16))
    assert tied(x).shape == (3, 16, 256)
    assert untied.num_parameters() - tied.num_parameters() == 256 * 32


def test_language_model_is_causal():
    torch.manual_seed(0)
    model = Transformer(model_config()).eval()
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("pooling", ["mean", "first"])
def test_classifier_sees_the_whole_document(pooling):
    torch.manual_seed(0)
    model = Transformer(model_config(task="classify", pooling=pooling), 257, num_classes=3, pad_id=256).eval()
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 256  # the last byte reaches the pooled vector, first token included
    with torch.no_grad():
        a, b = model(x), model(y)
    assert a.shape == (2, 3) and not torch.allclose(a, b)


def test_mean_pooling_skips_pads():
    torch.manual_seed(0)
    model = Transformer(model_config(task="classify", layers=1), 257, num_classes=2, pad_id=256).eval()
    x = torch.full((1, 16), 256)
    x[0, :4] = torch.tensor([104, 105, 33, 10])
    hidden = {}
    model.head.register_forward_hook(lambda m, args, out: hidden.setdefault("pooled", args[0]))
    with torch.no_grad():
        model(x)
        # The mean over the four real positions, recomputed by hand from the blocks' output.
        h = model.embed_scale * model.embed_tokens(x, model.dtype)
        h = model.blocks[0](h, model.rotary())
        h = torch.nn.functional.rms_norm(h, (32,), eps=model.config.rms_norm_eps)
    torch.testing.assert_close(hidden["pooled"], h[:, :4].mean(1), rtol=1e-5, atol=1e-5)


def test_a_classifier_needs_two_classes():
    with pytest.raises(ValueError, match="at least 2 classes"):
        Transformer(model_config(task="classify"), 257, num_classes=1, pad_id=256)


@pytest.mark.parametrize("task", ["lm", "classify"])
def test_gradient_checkpointing_changes_memory_not_gradients(task):
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        config = model_config(task=task, gradient_checkpointing=checkpointing)
        model = Transformer(config, 257, num_classes=3 if task == "classify" else 0, pad_id=256)
        model(x).float().square().mean().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    for key in grads[0]:
        torch.testing.assert_close(grads[0][key], grads[1][key], rtol=1e-5, atol=1e-7, msg=key)


def test_trm_fields_are_refused_on_a_transformer():
    with pytest.raises(cfg.ConfigError, match=r"model\.L_cycles"):
        model_config(L_cycles=3)
