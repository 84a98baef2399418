"""The transformer's all-reduce overlapped with its last backward: buckets start while the backward still runs, the
update is one process's, and a rank whose allocator fails after sending buckets redoes its samples without leaving
a peer's collective unmatched. gloo processes, no Ray."""

from __future__ import annotations

import pytest
import torch

from raytrm.distributed.launch import spawn
from raytrm.sync.process_group import ProcessGroupSync
from raytrm.train.trainer import Trainer
from tests.support.equivalence import compare, record_steps, train_alone

pytestmark = pytest.mark.slow  # worker processes

STEPS = 3
BUCKET_MB = 0.01  # the test model is small: buckets of ~10 KiB give it many, so some start early


def worker(rank, world_size, device, config, shares, micro_batches, fail_step=None):
    """One worker; with fail_step, rank 1's allocator "fails" once in that step, in its last backward, after some
    of its buckets were sent. Returns what rank 0 recorded, and rank 1's bytes sent before its failure."""
    trainer = Trainer(config, sync=ProcessGroupSync(device, bucket_mb=BUCKET_MB), shares=shares)
    trainer.set_micro_batch(micro_batches[rank])
    sent_before_failure = []
    if fail_step is not None and rank == 1:
        first = next(iter(trainer.model.parameters()))  # the embedding: the last gradient a backward finishes

        def fail(param):
            reducer = trainer.strategy.mode.reducer
            if trainer.step == fail_step and reducer.overlapped_bytes and not sent_before_failure:
                sent_before_failure.append(reducer.overlapped_bytes)
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")

        first.register_post_accumulate_grad_hook(fail)

    def halve(step):
        return trainer.set_micro_batch(max(1, trainer.micro_batch // 2))[0]

    recorded = record_steps(trainer, None, STEPS, on_out_of_memory=halve)
    return recorded if rank == 0 else sent_before_failure


def test_overlapped_sum_starts_during_backward_and_equals_one_process(text_config):
    config = text_config("lm")
    alone = train_alone(config, STEPS)
    spread = spawn(worker, 2, config, [5, 7], [2, 3])[0]
    result = compare(alone, spread)
    assert result["grad"] < 1e-5 and result["weights"] < 1e-4, result
    # Everything but the embedding's buckets is final before the backward ends, and started then.
    assert min(spread["overlap"]) > 0.5, spread["overlap"]


def test_three_ranks_with_different_cuts_send_the_same_buckets(text_config):
    config = text_config("lm")
    alone = train_alone(config, STEPS)
    spread = spawn(worker, 3, config, [2, 4, 6], [2, 1, 6])[0]  # one, four and one micro-batches
    result = compare(alone, spread)
    assert result["grad"] < 1e-5 and result["weights"] < 1e-4, result
    assert min(spread["overlap"]) > 0.5, spread["overlap"]


def test_out_of_memory_after_buckets_were_sent_redoes_the_step_exactly(text_config):
    config = text_config("lm")
    alone = train_alone(config, STEPS)
    rank0, sent = spawn(worker, 2, config, [6, 6], [3, 3], 1, timeout_s=120)
    assert len(sent) == 1 and sent[0] > 0  # the failure came after rank 1 had started summing
    result = compare(alone, rank0)
    assert result["grad"] < 1e-5 and result["loss"] < 1e-5 and result["weights"] < 1e-4, result
    assert all(torch.isfinite(g).all() for step in rank0["grads"] for g in step.values())
