"""Chat templates by name, for ``--chat-template NAME`` (llama.cpp's built-in template names).

A file without ``tokenizer.chat_template`` (or with one that does not suit) can chat with one of these, or with a
Jinja template given as text (``--chat-template '{% for m in messages %}...'``) or as a file
(``--chat-template-file FILE``). They are rendered like the file's own template, by
:meth:`moestream.tokenizer.GGUFTokenizer.apply_chat_template` (Jinja), so they are written in Jinja here, spelled
after llama.cpp's ``llm_chat_apply_template`` (src/llama-chat.cpp) for the same name. This module imports nothing:
the command line checks a name before anything heavy is imported.
"""

from __future__ import annotations

__all__ = ["CHAT_TEMPLATES", "chat_template_source"]

#: name -> Jinja source. ``bos_token`` is left out where llama.cpp's built-in leaves it to the tokenizer (the
#: file's ``add_bos_token`` adds it when the prompt is encoded).
CHAT_TEMPLATES: dict[str, str] = {
    # <|im_start|>role\ncontent<|im_end|>\n ... <|im_start|>assistant\n  (Qwen, Yi, OLMoE-Instruct ...)
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> ... (Llama 3.x)
    "llama3": (
        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
        "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"
    ),
    # <start_of_turn>user\ncontent<end_of_turn>\n ... <start_of_turn>model\n; the system message is put in front of
    # the first user message, as llama.cpp does (Gemma has no system role)
    "gemma": (
        "{% set ns = namespace(system='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
        "{% set ns.system = ns.system + (m['content'] | trim) %}{% else %}"
        "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}<start_of_turn>{{ role }}\n"
        "{% if ns.system and role != 'model' %}{{ ns.system }}\n\n{% set ns.system = '' %}{% endif %}"
        "{{ m['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    # <|role|>\ncontent<|end|>\n ... <|assistant|>\n (Phi-3)
    "phi3": (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    # <|role|>\ncontent<|endoftext|>\n ... <|assistant|>\n (Zephyr)
    "zephyr": (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    # [SYSTEM_PROMPT]..[/SYSTEM_PROMPT][INST]..[/INST] reply</s> (Mistral Small 3 and later)
    "mistral-v7": (
        "{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT] {{ m['content'] }}[/SYSTEM_PROMPT]"
        "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]{% else %} {{ m['content'] }}</s>{% endif %}"
        "{% endfor %}"
    ),
}


def chat_template_source(value: str) -> str | None:
    """The Jinja source ``--chat-template VALUE`` stands for: a name of :data:`CHAT_TEMPLATES`, or ``VALUE`` itself
    when it is a Jinja template (holds ``{%`` or ``{{``, as llama.cpp's ``--jinja`` takes one); None otherwise."""
    name = value.strip().lower()
    if name in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[name]
    if "{%" in value or "{{" in value:
        return value
    return None
