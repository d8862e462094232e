"""A checkpoint's chat template, rendered as transformers' `apply_chat_template` renders it.

The template comes from `chat_template.jinja` (transformers 5 writes it there) or the
`chat_template` of `tokenizer_config.json` (a string, or a list of named templates: the one
named "default"). It runs in jinja2's `ImmutableSandboxedEnvironment` with transformers'
environment (`utils/chat_template_utils.py`): `trim_blocks`, `lstrip_blocks`, the
`loopcontrols` extension, a `tojson` filter that keeps non-ASCII characters and takes
`indent` / `separators` / `sort_keys`, and the globals `raise_exception`, `strftime_now`,
`dict` and a `namespace` that refuses underscore names. The template sees `messages` (keys
whose value is None dropped), `tools` and `documents` (None), `add_generation_prompt` and the
tokenizer's named special tokens (`bos_token`, `eos_token`, ...). The rendered text is
tokenised without adding special tokens, as `apply_chat_template(tokenize=True)` does.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils

from moe_runtime.model import errors

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
#: The named special tokens transformers passes to a template (`special_tokens_map`).
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateError(ValueError):
    """The template failed on these messages (its own `raise_exception`, or a bad template)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without attribute access to the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore-prefixed attributes (as transformers')."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes: {name!r}"
            )


def environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """transformers' chat template environment (without its `{% generation %}` tracker)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


def _special_token(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """transformers' message preparation: None values dropped, reasoning aliased."""
    out: list[dict[str, Any]] = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """A compiled chat template and the special tokens it sees."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str] | None = None) -> None:
        try:
            self._template = environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"the chat template does not compile: {exc}") from exc
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str]) -> ChatTemplate | None:
        """The template of checkpoint directory `path`, None when it has none."""
        root = pathlib.Path(path)
        config: dict[str, Any] = {}
        config_path = root / TOKENIZER_CONFIG_FILE
        for file in (root / SPECIAL_TOKENS_FILE, config_path):
            if file.is_file():
                try:
                    loaded = json.loads(file.read_text())
                except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                    raise errors.CheckpointError(file, f"unreadable JSON: {exc}") from exc
                if isinstance(loaded, dict):
                    config.update(loaded)
        special = {k: v for k in SPECIAL_TOKENS if (v := _special_token(config.get(k)))}
        template_path = root / TEMPLATE_FILE
        source: Any = None
        if template_path.is_file():
            source = template_path.read_text()
        else:
            source = config.get("chat_template")
            if isinstance(source, list):
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise errors.CheckpointError(config_path, "chat_template must be a string")
        try:
            return cls(source, special_tokens=special)
        except TemplateError as exc:
            raise errors.CheckpointError(template_path, str(exc)) from exc

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of `messages`; TemplateError when the template refuses them."""
        try:
            return self._template.render(
                messages=normalize_messages(messages),
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"the chat template refused the messages: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise TemplateError(f"the chat template failed on the messages: {exc}") from exc
