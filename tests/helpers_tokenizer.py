"""A tiny ChatML tokenizer built in-process (no files, no network) for tests.

Byte-level BPE trained on a small corpus in well under a second, so any text round-trips through
encode/decode; special tokens `<|im_start|>`, `<|im_end|>` (eos) and `<|pad|>` (pad).
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
DEFAULT_SYSTEM = "You are a tiny test assistant."

# ChatML; like SmolLM2's template it adds a default system turn when the chat has none.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "system user assistant You are a helpful assistant.",
    "What is 7 + 3? Compute 12 - 5. Calculate 6 * 4. 9 + 9 = ? The answer is 10.",
    "What do you get when you add 3 to 7? What is the sum of 2 and 8? The product of 4 and 5 is 20.",
    "How many times does the letter 'r' appear in 'strawberry'? How many letters are in the word 'banana'?",
    "the and that from this have your their they which more other about one were also these people",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1,234 -5 \\boxed{12} $x=3$ \\frac{1}{2}",
    "I think it is 12. So the final answer is 42. Let me check: 6 + 6 = 12, yes.",
]


@lru_cache(maxsize=1)
def _trained_json(vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A fresh tokenizer object (the trained model is cached, so later calls are fast)."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_json(vocab_size)),
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
