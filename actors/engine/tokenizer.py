"""A small byte-level tokenizer with a ChatML template, built locally.

Every UTF-8 string round-trips exactly: text is split into bytes (GPT-2's
byte-to-unicode alphabet), each byte one token, with no merges. Ids 0–4 are
the special tokens, bytes follow. Saved as a regular HF fast tokenizer so
``AutoTokenizer.from_pretrained(dir)`` and ``apply_chat_template`` work.

A vision-language checkpoint's (``vision=True``) adds Qwen2-VL's vision tokens after the
bytes and a template that renders a message's image parts as
``<|vision_start|><|image_pad|><|vision_end|>`` (one pad per image: the engine expands it
to the image's token count, :mod:`actors.engine.multimodal`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Union

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
TOKENIZER_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
# Qwen2-VL's vision tokens, after the bytes (a text checkpoint's ids are unchanged)
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = range(TOKENIZER_VOCAB_SIZE,
                                                                  TOKENIZER_VOCAB_SIZE + len(VISION_TOKENS))
VL_TOKENIZER_VOCAB_SIZE = TOKENIZER_VOCAB_SIZE + len(VISION_TOKENS)

# ChatML; with tools, Hermes / Qwen 2.5's tool calling: the tools listed as JSON in a system turn
# (the conversation's own system message first in it), an assistant's calls as <tool_call> blocks
# after its content, a tool's result in a "tool" turn. Without tools the same bytes as plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_TEXT_CONTENT = "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
# Qwen2-VL's: a message's content is a string or a list of parts, text, an image or a video (its vision tokens; as
# Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's templates, a "video" part, not a video_url one)
VL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(_TEXT_CONTENT, (
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' or 'video' in part %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
))


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


def build_byte_tokenizer(vision: bool = False) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS + (VISION_TOKENS if vision else []))
    return tok


def save_tokenizer(directory: Union[str, Path], vision: bool = False) -> None:
    """tokenizer.json + tokenizer_config.json (with the chat template) + special_tokens_map.json;
    ``vision``: with the vision tokens and :data:`VL_CHAT_TEMPLATE`."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_byte_tokenizer(vision), bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END] + (VISION_TOKENS if vision else []),
    )
    fast.chat_template = VL_CHAT_TEMPLATE if vision else CHAT_TEMPLATE
    fast.save_pretrained(str(directory))


def load_tokenizer(directory: Union[str, Path]):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
