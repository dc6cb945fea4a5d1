"""A Llama-3.1-shaped tokenizer built offline (no Llama tokenizer ships here): for BOS / token-id parity tests.

What it keeps of Llama-3.1's ``tokenizer.json`` and ``tokenizer_config.json``: the special tokens with their ids
(``<|begin_of_text|>`` 128000, ``<|end_of_text|>`` 128001, ``<|start_header_id|>`` 128006, ``<|end_header_id|>``
128007, ``<|eot_id|>`` 128009), the post-processor (``TemplateProcessing`` single = ``<|begin_of_text|> $A``: a BOS
in front of every text tokenised with ``add_special_tokens=True``, also one that already starts with it), byte-level
pre-tokenisation and decoding, ``bos_token`` / ``eos_token``, and a chat template that writes ``{{ bos_token }}``
first and the 3.1 header / ``<|eot_id|>`` layout (the real one's tool and date branches left out: the parts that
matter for token ids at the start of a prompt are these). What it does not keep: the 128,000-entry BPE vocabulary;
here every byte is one token (no merges; the other ids up to 128,000 are unused placeholders), so the ids of a text
do not depend on where it was cut, which lets a test compare the released re-tokenised prompt with our
token-in/token-out concatenation id by id.
"""

import json
import os

SPECIAL = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|reserved_special_token_0|>": 128002,
           "<|reserved_special_token_1|>": 128003, "<|finetune_right_pad_id|>": 128004,
           "<|reserved_special_token_2|>": 128005, "<|start_header_id|>": 128006, "<|end_header_id|>": 128007,
           "<|eom_id|>": 128008, "<|eot_id|>": 128009}
BOS_ID = SPECIAL["<|begin_of_text|>"]

LLAMA31_LIKE_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}{{- 'Today Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def build_llama3_tokenizer(out_dir: str):
    """Write the tokenizer to ``out_dir`` (``tokenizer.json`` + ``tokenizer_config.json``, loadable with
    ``AutoTokenizer.from_pretrained(out_dir)``) and return it loaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import AutoTokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    # unused entries up to Llama-3's 128,000 so that the special tokens keep their real ids (never produced: no merges)
    vocab.update({f"<unused_{i}>": i for i in range(len(vocab), BOS_ID)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    data = json.loads(tok.to_str())
    data["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for t, i in SPECIAL.items()]
    data["post_processor"] = json.loads(processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", BOS_ID)]).__getstate__())
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(data, f)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                   "eos_token": "<|eot_id|>", "chat_template": LLAMA31_LIKE_CHAT_TEMPLATE,
                   "model_max_length": 131072, "clean_up_tokenization_spaces": False}, f)
    return AutoTokenizer.from_pretrained(out_dir)
