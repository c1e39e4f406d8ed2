"""CUDA-graph capture of a step, for the GPU tests' "no host synchronisation" checks."""

import torch


def assert_capture_replays_eager(step):
    """Warm ``step`` up on a side stream, capture it into a CUDA graph, replay it and check that
    the captured outputs equal the eager ones bit for bit (capture fails on a host sync)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            eager = step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)
