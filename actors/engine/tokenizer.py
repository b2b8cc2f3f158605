"""A small byte-level tokenizer with a ChatML template, built locally.

Every UTF-8 string round-trips exactly: text is split into bytes (GPT-2's
byte-to-unicode alphabet), each byte one token, with no merges. Ids 0–4 are
the special tokens, bytes follow. Saved as a regular HF fast tokenizer so
``AutoTokenizer.from_pretrained(dir)`` and ``apply_chat_template`` work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Union

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
TOKENIZER_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _byte_vocab() -> Dict[str, int]:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2 order: the byte value each symbol stands for
    symbols = sorted(alphabet, key=lambda ch: _BYTE_OF[ch])
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(symbols)})
    return vocab


def _bytes_to_unicode() -> Dict[int, str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


_BYTE_OF = {ch: b for b, ch in _bytes_to_unicode().items()}


def build_byte_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def save_tokenizer(directory: Union[str, Path]) -> None:
    """tokenizer.json + tokenizer_config.json (with the chat template) + special_tokens_map.json."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_byte_tokenizer(), bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))


def load_tokenizer(directory: Union[str, Path]):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
