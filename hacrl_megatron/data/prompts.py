"""Per-agent prompt formatting (docs/algorithm.md §6: each agent formats the prompt with its own template).

- Chat path: the agent's tokenizer has a chat template → one user turn holding the question and
  ``CHAT_INSTRUCTION``, rendered with ``apply_chat_template(..., add_generation_prompt=True,
  tokenize=False)``.
- Plain path: ``PLAIN_TEMPLATE`` = ``"Q: {question} A: "``. It is short on purpose (the CPU demo
  runs tiny character-level models); the SFT warm-up teaches the ``\\boxed{}`` format. The trailing
  space means the response, and the SFT target, start directly with their text in both paths.
"""

from __future__ import annotations

CHAT_INSTRUCTION = "Put the final answer in \\boxed{}."
PLAIN_TEMPLATE = "Q: {question} A: "
TEMPLATES = ("auto", "chat", "plain")


def has_chat_template(tokenizer) -> bool:
    """True when ``tokenizer`` carries a chat template (HF ``chat_template`` attribute)."""
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def format_prompt(question: str, tokenizer=None, template: str = "auto") -> str:
    """The prompt text an agent samples from.

    Args:
        question: the problem (``PromptRecord.question``).
        tokenizer: the agent's HF tokenizer, or None.
        template: ``"auto"`` (chat when the tokenizer has a template, else plain), ``"chat"``,
            ``"plain"``, or a custom format string containing ``{question}``.
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty str, got {question!r}")
    if template not in TEMPLATES:
        if "{question}" not in template:
            raise ValueError(f"template={template!r} must be one of {TEMPLATES} or contain '{{question}}'")
        return template.replace("{question}", question)
    use_chat = template == "chat" or (template == "auto" and has_chat_template(tokenizer))
    if not use_chat:
        return PLAIN_TEMPLATE.format(question=question)
    if not has_chat_template(tokenizer):
        raise ValueError("template='chat' needs a tokenizer with a chat_template; use 'plain' or 'auto'")
    messages = [{"role": "user", "content": f"{question}\n{CHAT_INSTRUCTION}"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text
