"""Shared by the tests: moved out of test_logprobs.py (which imports them back) so other test modules import
them from here, not from a test module."""

from __future__ import annotations

import torch


def tiny_llama(tie_word_embeddings=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie_word_embeddings)
    return LlamaForCausalLM(config).eval()
