import torch

from raytrm.bench.timing import count_flops


def test_flops_of_a_compiled_call_are_counted_eagerly_without_tracing_a_graph():
    a, b = torch.randn(32, 48), torch.randn(48, 16)
    traced = []

    def backend(graph, example_inputs):
        traced.append(graph)
        return graph.forward

    product = torch.compile(lambda: a @ b, backend=backend)
    assert count_flops(product) == 2 * 32 * 48 * 16
    assert traced == []  # no graph was compiled for the counter
    product()
    assert len(traced) == 1  # outside the counter the call compiles as usual
