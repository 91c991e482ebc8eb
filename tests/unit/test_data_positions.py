"""Document boundaries in a batch: position ids reset after each EOS, on the device of the tokens."""

from __future__ import annotations

import torch

from data.stream import document_positions


def test_position_ids_reset_after_eos():
    eos = 9
    tokens = torch.tensor([[1, 2, eos, 3, 4, 5, eos, eos, 6], [eos, 1, 2, 3, 4, 5, 6, 7, 8]])
    assert document_positions(tokens, eos).tolist() == [
        [0, 1, 2, 0, 1, 2, 3, 0, 0],
        [0, 0, 1, 2, 3, 4, 5, 6, 7],
    ]


def test_position_ids_stay_on_the_tokens_device():
    """Evaluation computes positions from a batch already on the GPU; the meta device stands in for it
    here (a CPU index into a GPU model's RoPE table would make the compiled graph fall back)."""
    tokens = torch.zeros((2, 8), dtype=torch.int64, device="meta")
    positions = document_positions(tokens, eos_id=9)
    assert positions.device == tokens.device and positions.shape == (2, 8)
