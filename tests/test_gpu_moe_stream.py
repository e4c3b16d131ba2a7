"""Mode offload's experts' ring on the device (skipped without a GPU): a prompt's step streams every routed
layer's experts into ring slots and runs them with the device expert kernels, decode keeps them on the
host, against the CPU engine's logits (2e-3 relative, the same argmax) -- the checks of
test_moe_stream_emulated.py on the real kernels, copies and events.

    python3 -m pytest -m gpu tests/test_gpu_moe_stream.py
"""
from __future__ import annotations

import pytest

from test_moe_stream_emulated import (check_batch_of_prompts_matches, check_block_format_experts_stream,
                                      check_prompt_streams_and_matches, check_ring_and_link_share,
                                      check_slots_reused_in_one_step, model)  # noqa: F401

pytestmark = pytest.mark.gpu


def test_a_streamed_prompt_step_on_the_device(model):  # noqa: F811
    check_prompt_streams_and_matches(*model)


def test_streamed_layers_beside_resident_experts_on_the_device(model):  # noqa: F811
    check_prompt_streams_and_matches(*model, resident=3)


def test_a_batch_of_prompts_in_one_streamed_step_on_the_device(model):  # noqa: F811
    check_batch_of_prompts_matches(*model)


def test_ring_slots_are_reused_within_a_step_on_the_device():
    check_slots_reused_in_one_step()


def test_q4_k_m_experts_stream_on_the_device():
    check_block_format_experts_stream()


def test_a_ring_and_a_link_share_together_on_the_device(model):  # noqa: F811
    check_ring_and_link_share(*model)
