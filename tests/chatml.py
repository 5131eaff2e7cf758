"""A ChatML tokenizer as a user's local directory holds one: byte-level BPE trained here with `tokenizers` on a few
sentences, <|im_start|> / <|im_end|> / <|endoftext|> specials at the vocabulary's end (end of sequence
<|endoftext|>, as Qwen's base models),
a ChatML chat template, saved with save_pretrained. Nothing is downloaded."""
from __future__ import annotations

from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["the user asks a question and the assistant answers it in a few words",
          "question answer system user assistant tool call weather city name arguments",
          "0 1 2 3 4 5 6 7 8 9 { } [ ] : , \" hello why so brief please"]

# a template of role tags (<|user|> ... <|end|>), for the byte tokenizer's chat tests
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}"
            "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chatml_tokenizer(out: Path, template: str = CHATML) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_special_tokens(SPECIALS)  # at the vocabulary's end, as Qwen's (not at Llama's default ids 1 and 2)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=SPECIALS[1:])
    hf.chat_template = template
    hf.save_pretrained(out)
    return out
