"""A row of packed rollouts pads its tail as one more (untrained) sequence, never one sequence per
pad token: kernels that split a row at position 0 (fla's GatedDeltaNet chunks, the varlen and flex
document masks) would otherwise run one segment per pad token. Measured on one H200 before the fix
(benchmarks/short_rollouts_profile.sh, docs/benchmarks.md): 256 rollouts of ~82 tokens in a 32K row
left ~11K pad tokens, fla ran ~12K chunks per GatedDeltaNet layer (12 GiB of states forward, 12 GiB
backward) and the step took twice the SFT step's time."""

from __future__ import annotations

import math

import torch

from components.data.rollouts import PACKAGED_ROLLOUTS, read_rollouts

GDN_CHUNK = 64  # fla's chunk length


def _segments(positions: torch.Tensor) -> list[int]:
    """Lengths of the row's segments, split where positions is 0 (the kernels' convention)."""
    starts = (positions == 0).nonzero(as_tuple=True)[0].tolist() + [positions.numel()]
    return [b - a for a, b in zip(starts, starts[1:])]


def test_packed_rows_pad_as_one_segment():
    t = read_rollouts(PACKAGED_ROLLOUTS, pack_to=32768)
    seq_ids = t["sequence_ids"]
    assert t["positions"].shape[1] == 32768
    for r in range(seq_ids.shape[0]):
        n_seqs = int(seq_ids[r].max()) + 1
        pad = int((seq_ids[r] < 0).sum())
        assert pad > 1000, "the packaged rollouts leave a long pad tail in a 32K row (what this test is about)"
        segs = _segments(t["positions"][r])
        assert len(segs) == n_seqs + 1, f"row {r}: {len(segs)} segments for {n_seqs} sequences and one pad tail"
        assert segs[-1] == pad
        # fla's chunked kernels hold one state per chunk: about the row's length over the chunk
        chunks = sum(math.ceil(n / GDN_CHUNK) for n in segs)
        assert chunks <= 32768 // GDN_CHUNK + len(segs)


def test_pad_tail_layout_does_not_change_the_trained_tokens_logits():
    """Paired: the same row with its pad tail as one segment (the fix) and as one segment per pad token
    (before): the model's outputs at every non-pad token are identical (pads follow every sequence)."""
    from framework.api import build_model

    torch.manual_seed(0)
    model = build_model("qwen35_debug_moe", n_layers=2).eval()
    t = read_rollouts(PACKAGED_ROLLOUTS, pack_to=512)
    row = 0
    tokens = t["input_ids"][row:row + 1] % 256
    pos_new = t["positions"][row:row + 1]
    real = t["sequence_ids"][row] >= 0
    assert (~real).sum() > 1, "the row needs a pad tail"
    pos_old = pos_new.clone()
    pos_old[0, ~real] = 0  # one segment per pad token
    with torch.no_grad():
        new = model(tokens, positions=pos_new)
        old = model(tokens, positions=pos_old)
    assert torch.equal(new[0, real], old[0, real])
    assert not torch.equal(new[0, ~real], old[0, ~real])  # the pads themselves did change: the layouts differ
