"""Chat test data built offline: multi-turn conversations (system, user, assistant, tool turns),
ChatML-style templates written here, and a word-level tokenizer that knows their tokens."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# ChatML: every turn is wrapped in <|im_start|>ROLE ... <|im_end|>, so tokens surround the assistant text.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The same rendering, with the assistant text (and its end token) inside {% generation %} blocks.
CHATML_GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
_NAMES = ["ada", "bob", "cy", "dee", "eve", "fay"]
_CITIES = ["paris", "rome", "oslo", "lima", "cairo", "delhi"]


def conversations(n: int = 48, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` conversations: a system prompt, one or two user/assistant exchanges, some with a tool turn."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name, city = rng.choice(_NAMES), rng.choice(_CITIES)
        conv = [
            {"role": "system", "content": "you are a helpful travel agent ."},
            {"role": "user", "content": f"hi , i am {name} . where should i go ?"},
            {"role": "assistant", "content": f"hello {name} , go to {city} ."},
        ]
        if rng.random() < 0.5:
            conv += [
                {"role": "user", "content": f"what is the weather in {city} ?"},
                {"role": "assistant", "content": f"call weather {city}"},
                {"role": "tool", "content": f"sunny in {city}"},
                {"role": "assistant", "content": f"it is sunny in {city} , {name} ."},
            ]
        out.append(conv)
    return out


def chat_tokenizer(template: str = CHATML) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the conversations' words and the roles; eos <|im_end|>."""
    words = [m["content"] for c in conversations() for m in c] + ["system user assistant tool"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(words, trainer=trainers.WordLevelTrainer(special_tokens=SPECIALS))
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>", model_max_length=512
    )
    out.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    out.chat_template = template
    return out
