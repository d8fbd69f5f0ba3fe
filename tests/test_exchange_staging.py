"""Point-to-point transfers through host copies: what a CUDA tensor over gloo takes (gloo's send
and recv read the tensor's memory from the CPU). Forced here on CPU tensors, so the copying and
the handles' waits are checked on every machine; `stages_through_host` picks the path."""

import torch

from harness import run_ranks


def _ring(forced: bool):
    import exatrain as et
    from exatrain.comm.collectives import exchange

    mesh = et.init(et.Plan(data=3))
    try:
        axis = mesh.axis("data")
        rank, n = axis.rank, axis.size
        send = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
        left, right = torch.full((2, 3), -1.0), torch.full((2, 3), -1.0)
        works = exchange([(send, (rank + 1) % n), (send * 2, (rank - 1) % n)],
                         [(left, (rank - 1) % n), (right, (rank + 1) % n)], axis,
                         tag="test", through_host=(lambda t, g: True) if forced else
                         (lambda t, g: False))
        if forced:  # what is sent was copied when the exchange began
            send.fill_(0)
        for w in works:
            w.wait()
        return {"left": left, "right": right}
    finally:
        mesh.close()


def test_a_staged_exchange_delivers_what_a_direct_one_does():
    direct, staged = run_ranks(3, _ring, False), run_ranks(3, _ring, True)
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    for rank in range(3):
        assert torch.equal(staged[rank]["left"], base + 10 * ((rank - 1) % 3))
        assert torch.equal(staged[rank]["right"], 2 * (base + 10 * ((rank + 1) % 3)))
        assert torch.equal(staged[rank]["left"], direct[rank]["left"])
        assert torch.equal(staged[rank]["right"], direct[rank]["right"])


def test_only_cuda_tensors_over_gloo_are_staged():
    from exatrain.comm.collectives import stages_through_host

    assert not stages_through_host(torch.zeros(2), None)  # a CPU tensor: gloo reads it directly
