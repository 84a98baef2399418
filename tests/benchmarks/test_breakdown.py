import pytest
import torch

from benchmarks import breakdown as bd
from benchmarks.trm import bench_trm
from raytrm.errors import UserError
from raytrm.fastpaths import onednn
from raytrm.train import side_by_side as threaded


@pytest.mark.slow
def test_a_breakdown_finds_every_product_the_flop_counter_counts(tmp_path):
    breakdowns: list[bd.Breakdown] = []
    [row] = bench_trm(["mlp_t"], [32], 4, 2, "cpu", tmp_path, repeats=1, breakdowns=breakdowns)
    [step] = breakdowns
    assert (step.variant, step.hidden, step.impl, step.step_seconds) == ("mlp_t", 32, "raytrm", row.step_seconds)
    # TRM-MLP's only counted FLOPs are its products (no attention), so the shapes found must add up to the count.
    assert sum(2 * p.batch * p.m * p.k * p.n * p.calls for p in step.products) == round(row.gflop_per_step * 1e9)
    assert step.attention_seconds == 0 and step.bound is None  # no reference beside it
    assert step.products_seconds == pytest.approx(sum(p.seconds for p in step.products))
    assert 0 < step.products_seconds < step.profiled_seconds and 0 < step.products_share < 1
    assert [p.seconds for p in step.products] == sorted((p.seconds for p in step.products), reverse=True)
    assert len(step.others) == bd.NAMED_OTHERS
    text = bd.format_breakdowns(breakdowns)
    assert "mlp_t hidden 32, raytrm" in text and "of the ceiling" in text
    # Linear layers run on oneDNN where it serves, their rates beside oneDNN's ceiling; the weights' gradients on mm.
    assert {p.onednn for p in step.products} == ({True, False} if onednn.ENABLED else {False})
    assert (step.onednn_gflops is not None) == onednn.ENABLED
    if onednn.ENABLED:
        assert "of oneDNN's ceiling" in text
    if threaded.available(torch.device("cpu"), compiled=False) and bd._watching_all_threads():
        # The step profiled as it runs: two threads' micro-batches side by side, every product of both found above.
        assert step.product_threads == 2 and "micro-batches side by side on 2 threads" in text


def test_the_bound_is_the_reference_step_over_raytrms_products_alone():
    raytrm = bd.Breakdown("attention", 512, "raytrm", step_seconds=4.0, matmul_gflops=190.0)
    raytrm.profiled_seconds, raytrm.products_seconds = 5.0, 4.0  # products: 80% of the step, 3.2 s of its median
    reference = bd.Breakdown("attention", 512, "reference", step_seconds=4.8, matmul_gflops=190.0)
    assert bd.bound(raytrm, reference) == pytest.approx(4.8 / 3.2)


def test_a_product_reads_its_operands_wherever_the_op_keeps_them():
    assert bd._operands("aten::mm", [[3, 5], [5, 7]]) == (1, 3, 5, 7)
    assert bd._operands("aten::addmm", [[7], [3, 5], [5, 7], [], []]) == (1, 3, 5, 7)
    assert bd._operands("aten::bmm", [[2, 3, 5], [2, 5, 7]]) == (2, 3, 5, 7)
    assert bd._operands("aten::baddbmm", [[2, 3, 7], [2, 3, 5], [2, 5, 7], [], []]) == (2, 3, 5, 7)
    # oneDNN's linear: x [2, 3, 5] @ weight [7, 5].T is a [6, 5] @ [5, 7] product.
    assert bd._operands(bd.LINEAR, [[2, 3, 5], [7, 5], [], [], [], []]) == (1, 6, 5, 7)
    assert bd.Product(3, 5, 7, 2, calls=10, seconds=1e-6).gflops == pytest.approx(2 * 2 * 3 * 5 * 7 * 10 / 1e-6 / 1e9)


def test_a_breakdown_off_the_cpu_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"--breakdown profiles CPU steps only, not cuda; fix: drop --breakdown"):
        bd.cpu_only(torch.device("cuda"))
    bd.cpu_only(torch.device("cpu"))


@pytest.mark.slow
def test_cli_prints_the_breakdown_and_writes_it_beside_the_rows(tmp_path, capsys):
    import json

    from benchmarks.cli import main

    out = tmp_path / "bench.json"
    argv = ["trm", "--variants", "mlp_t", "--hidden", "16", "--batch", "2", "--threads", "1"]
    assert main([*argv, "--repeats", "1", "--device", "cpu", "--breakdown", "--json", str(out)]) == 0
    assert "mlp_t hidden 16, raytrm" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert [r["impl"] for r in results["rows"]] == [b["impl"] for b in results["breakdowns"]] == ["raytrm"]
    assert 0 < results["breakdowns"][0]["products_share"] < 1
