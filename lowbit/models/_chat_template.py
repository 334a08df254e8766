"""Chat prompts rendered from a GGUF file's ``tokenizer.chat_template`` (a Jinja template).

The template comes from a model file, so it is untrusted: it runs in jinja2's immutable sandbox
(no attribute access to internals, no mutation of the values passed in, no imports). The names a
template sees are the ones Hugging Face's ``apply_chat_template`` passes: ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception`` (plus
``strftime_now`` and a ``tojson`` filter that keeps non-ASCII text).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ._gguf_tokenizer import special_token_ids

Messages = str | Sequence[Mapping[str, Any]]


class _TemplateRaised(Exception):
    """``raise_exception(...)`` called by a template."""


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(value: Any, indent: int | None = None, **kwargs: Any) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; chat prompts need the plain JSON.
    sort_keys = bool(kwargs.get("sort_keys", False))
    return json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    """The sandboxed, compiled template (cached: the same file's template is reused per prompt)."""
    # jinja2 (~80 ms, 20 modules) loads with the first chat template, not with `import lowbit`.
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ValueError(f"tokenizer.chat_template is not a valid Jinja template: {e}") from e


@functools.lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The names `template` reads from its caller (``messages``, ``tools``, ...): a template
    that never reads ``tools`` ignores any tools passed to it."""
    from jinja2 import meta  # lazily, as in `_compile`

    compiled = _compile(template)
    return frozenset(meta.find_undeclared_variables(compiled.environment.parse(template)))


def _as_messages(messages: Messages) -> list[dict[str, Any]]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if not messages:
        raise ValueError("messages is empty; give at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] is {m!r}; each needs 'role' and 'content'")
    return [dict(m) for m in messages]


def render_chat_template(
    template: str,
    messages: Messages,
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **variables: Any,
) -> str:
    """Render a Jinja chat template in a sandbox, as ``apply_chat_template`` does.

    Args:
      template: the Jinja source (e.g. a GGUF file's ``tokenizer.chat_template``).
      messages: a user message, or a list of ``{"role": ..., "content": ...}`` dicts.
      add_generation_prompt: end with the assistant turn's opening so the model answers.
      bos_token, eos_token: the texts of the vocab's BOS/EOS tokens.
      variables: further names for the template (e.g. ``tools``, ``date_string``).

    Raises:
      ValueError: for malformed messages, a template that does not parse, one that calls
        ``raise_exception`` (its message is kept), or one that fails while rendering
        (including the sandbox refusing an unsafe operation).
    """
    import jinja2  # lazily, as in `_compile`

    compiled = _compile(template)
    try:
        return compiled.render(
            messages=_as_messages(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **variables,
        )
    except _TemplateRaised as e:
        raise ValueError(f"tokenizer.chat_template refused the messages: {e}") from None
    except (jinja2.TemplateError, TypeError, KeyError, AttributeError, IndexError) as e:
        raise ValueError(
            f"tokenizer.chat_template failed to render: {type(e).__name__}: {e}"
        ) from e


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A GGUF file's chat template with its BOS/EOS texts: call it to format a prompt.

    Attributes:
      template: the Jinja source.
      bos_token, eos_token: texts passed to the template.
      strip_bos: drop a leading ``bos_token`` from the result, because the tokenizer adds BOS
        itself (``encode`` would otherwise start with two, as llama.cpp warns).
    """

    template: str
    bos_token: str = ""
    eos_token: str = ""
    strip_bos: bool = False

    @property
    def takes_tools(self) -> bool:
        """Whether the template renders a ``tools`` list (else it ignores one)."""
        return "tools" in template_variables(self.template)

    def __call__(
        self, messages: Messages, *, add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """The prompt text for `messages` (a user message, or role/content dicts); `variables`
        are further names for the template (e.g. ``tools``, as `render_chat_template`)."""
        text = render_chat_template(
            self.template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **variables,
        )
        if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return text


def chat_template_from_gguf(metadata: Mapping[str, Any]) -> ChatTemplate:
    """The ``messages -> prompt`` formatter from a GGUF file's ``tokenizer.chat_template``.

    The prompt is meant for ``tokenizer.encode(prompt)`` (with special tokens): when the
    vocab adds BOS itself, a ``bos_token`` the template writes first is dropped.

    Raises:
      ValueError: when the file has no chat template or it is not valid Jinja.
    """
    template = metadata.get("tokenizer.chat_template")
    if not isinstance(template, str) or not template:
        raise ValueError(
            "the GGUF file has no tokenizer.chat_template metadata; format the prompt yourself"
        )
    _compile(template)  # fail now, not at the first prompt
    special = special_token_ids(metadata)
    tokens = metadata.get("tokenizer.ggml.tokens", [])

    def text(i: int | None) -> str:
        return "" if i is None else str(tokens[i])

    return ChatTemplate(
        template=template,
        bos_token=text(special.bos),
        eos_token=text(special.eos),
        strip_bos=special.add_bos,
    )
