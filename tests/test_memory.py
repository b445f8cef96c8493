"""experiments/memory.py: the counts experiments/speed.md's memory table rests on, checked against a
real model."""
import sys
from pathlib import Path

import pytest

from experiments import memory  # noqa: E402
from machinery import memory as counts

TINY = dict(vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, tied=True)
# the coefficients of one run of experiments/memory.py (experiments/speed.md), to test the search
MEASURED = {"plain_backward": 0.202, "head_with_weight_grad_per_position": 4.02,
            "head_weight_grad": 1.0, "embedding_backward": 3.0, "head_per_position": 12.0,
            "no_grad_decoder": 0.581, "entropy_head_per_position": 16.02,
            "checkpointed_per_token": 4.0, "checkpointed_backward": 1.116, "decode_per_row": 34.0}


@pytest.mark.parametrize("tied", [True, False])
def test_param_count_is_the_models(tied):
    model = memory.build(2, dict(TINY, tied=tied))
    assert counts.param_count(dict(TINY, tied=tied)) == sum(p.numel() for p in model.parameters())
    # Qwen2.5-0.5B's published count, 0.49B (0.36B without the embedding)
    assert counts.param_count(counts.SHAPES["Qwen2.5-0.5B"]) == 494_032_768


def test_layer_activations_are_the_inventory():
    """What one more layer holds per token after the forward, read from torch's profiler as
    memory.py reads it, is exactly layer_act_bytes: the (layers, rows) difference cancels the bf16
    weight copies, the head and everything outside the layers. A formula that forgot the per-layer
    bf16 mask, the repeated keys and values, or a norm's 1 / rms would be off by 2L, 2 x 2 x nh x d
    or 4 bytes."""
    held = {}
    for layers in (1, 2):
        model = memory.build(layers, TINY)
        for rows in (1, 2):
            held[layers, rows] = memory.measure_update(model, rows, 24, 24, 8, 4096)["held"]
    per_token = (held[2, 2] - held[2, 1] - held[1, 2] + held[1, 1]) / 48
    assert per_token == counts.layer_act_bytes(TINY, 48) == 3320


def test_settings_are_the_largest_that_fit():
    lengths = dict(prompt_len=240, new_tokens=512)
    s = counts.SHAPES["Qwen2.5-0.5B"]
    chosen = {card: counts.settings_for(s, card, MEASURED, **lengths) for card in counts.CARDS_GIB}
    assert chosen[80]["micro_batch_size"] == 16 and chosen[80]["logprob_chunk"] == 4096  # defaults
    for card, got in chosen.items():
        assert counts.fits(got["peak"], card)
        assert not got["gradient_checkpointing"]
        if got["micro_batch_size"] < 16:  # twice the micro-batch does not fit, even in small chunks
            bigger = counts.predict(s, 2 * got["micro_batch_size"], 256, False, 256, MEASURED,
                                    **lengths)
            assert not counts.fits(bigger["peak"], card)
    micro = [chosen[card]["micro_batch_size"] for card in counts.CARDS_GIB]
    assert micro == sorted(micro, reverse=True) and micro[-1] < 16
    # 7B's float32 weights, gradients and AdamW moments alone, 16 bytes x 7.6B: no card holds them
    assert counts.settings_for(counts.SHAPES["Qwen2.5-7B"], 80, MEASURED, **lengths) is None
