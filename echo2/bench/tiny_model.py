"""A tiny randomly initialised causal LM with its own tokenizer: the learner of the overlap
benchmark's timing workload, and the model of the test suite (``tests/conftest.py``).

A 2-layer Llama (hidden size 32) with a 300-token byte-level BPE tokenizer trained on arithmetic
chats: a real optimizer step on it takes milliseconds on a CPU, so a benchmark can pad it to any
step time and a test can train it. ``make_tiny_moe_model`` is its mixture-of-experts twin (a
2-layer Qwen3-MoE, same tokenizer), for the MoE tests (``tests/e2e/test_moe.py``).
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def arithmetic_tokenizer():
    """A 300-token byte-level BPE tokenizer trained on arithmetic chats, with the chat template above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>"
              for a in range(10) for b in range(10)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(path: Path, *, hidden_size: int = 32, num_attention_heads: int = 2) -> Path:
    """A 2-layer Llama with a 300-token byte-level BPE tokenizer trained on arithmetic chats.

    The default heads are 16 wide; vLLM's CPU attention needs at least 32 (``hidden_size=64``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = arithmetic_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_attention_heads, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.pad_token_id)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def make_tiny_moe_model(path: Path, *, hidden_size: int = 32, num_experts: int = 4, experts_per_token: int = 2) -> Path:
    """A 2-layer Qwen3-MoE at random weights (every layer sparse: ``num_experts`` experts of width 16,
    ``experts_per_token`` routed per token), with ``make_tiny_model``'s tokenizer.

    Saved by ``save_pretrained``, so in the Hub's per-expert layout (``mlp.experts.<e>.gate_proj.weight``...),
    which transformers fuses into 3-D tensors on load (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``).
    """
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fast = arithmetic_tokenizer()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(fast), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                            moe_intermediate_size=16, num_experts=num_experts, num_experts_per_tok=experts_per_token,
                            decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
                            bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                            pad_token_id=fast.pad_token_id)
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path
