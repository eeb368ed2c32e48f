"""Tool calls in a family's own syntax: which one a chat template uses, the grammar that makes a model write one
(``tool_choice`` ``"required"`` or a named function), and the parse of a reply back into OpenAI's ``tool_calls``.

The syntax is the one the template itself renders for an assistant message's ``tool_calls`` (so a call the model
writes is read back, and a call the client sends back is rendered, the same way):

- ``hermes`` (Qwen 3, Qwen 2.5, Hermes): ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``;
- ``qwen-xml`` (Qwen 3.5, Qwen3-Coder): ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>``;
- ``glm`` (GLM 4.5-4.7): ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>``;
- ``harmony`` (gpt-oss): ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`` ended by
  ``<|call|>`` (an end-of-generation token).

In the XML styles a string value is written as it is, any other value as JSON (as the templates render them).
A template that never reads ``tools`` (DeepSeek's, the embedded model's) cannot show a model its tools, and one
whose syntax is none of these (Gemma 4's ``<|tool_call>call:...``) cannot be parsed: :func:`tool_format` says
why (the server's 400).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from .structured import json_lark


class ToolFormatError(ValueError):
    """The template cannot take tools (message: why)."""


def _lark_str(text: str) -> str:
    """A Lark string literal of ``text``."""
    return json.dumps(text, ensure_ascii=False)


#: the markup of the syntaxes that a vocabulary may hold as one token (a control token, if it is one, is named by
#: its id in the grammar: text never matches a control token)
MARKUP = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<|channel|>",
          "<|constrain|>", "<|message|>")


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call syntax (see the module docstring). ``starts``: the texts that open a call in the
    model's output (control tokens as their text)."""

    name: str
    starts: tuple[str, ...]

    def find(self, raw: str) -> int:
        """Where the first call begins in ``raw`` (-1: nowhere)."""
        found = [i for i in (raw.find(s) for s in self.starts) if i >= 0]
        return min(found, default=-1)

    # --- the grammar of one call to one of ``tools`` (OpenAI's function tools) -------------------------------
    def lark(self, tools: list[dict], control: dict[str, int] | None = None) -> str:
        """A Lark grammar (llguidance's dialect) of one call to any of ``tools`` whose arguments follow the
        function's ``parameters`` schema. ``control``: markup text -> id of the vocabulary's control token that
        spells it (written ``<[id]>``: a control token is never matched by text)."""
        control = control or {}
        if control:
            pat = re.compile("|".join(re.escape(t) for t in sorted(control, key=len, reverse=True)))

            def lit(text: str) -> str:
                parts, p = [], 0
                for m in pat.finditer(text):
                    if m.start() > p:
                        parts.append(_lark_str(text[p:m.start()]))
                    parts.append(f"<[{control[m.group()]}]>")
                    p = m.end()
                if p < len(text):
                    parts.append(_lark_str(text[p:]))
                return " ".join(parts)
        else:
            lit = _lark_str
        rules, alts = [], []
        for i, t in enumerate(tools):
            fn = t["function"]
            schema = dict(fn.get("parameters") or {"type": "object", "properties": {}})
            schema.setdefault("additionalProperties", False)  # the declared parameters only (OpenAI's strict mode)
            alts.append(f"call_{i}")
            rules.append(f"call_{i}: {self._call_rule(fn['name'], schema, i, rules, lit)}")
        return "start: " + " | ".join(alts) + "\n" + "\n".join(rules) + "\n"

    def _call_rule(self, name: str, schema: dict, i: int, rules: list[str], lit: Callable[[str], str]) -> str:
        if self.name == "hermes":
            rules.append(f"args_{i}: {json_lark(schema)}")
            return (lit('<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
                    + f" args_{i} " + lit("}\n</tool_call>"))
        if self.name == "harmony":
            rules.append(f"args_{i}: {json_lark(schema)}")
            return lit(f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>") + f" args_{i}"
        # the XML styles: one element per property, the required ones first, in the schema's order
        props = schema.get("properties") or {}
        required = [k for k in schema.get("required") or [] if k in props]
        parts = []
        for j, key in enumerate(required):
            sub = props[key] if isinstance(props[key], dict) else {}
            choices = sub.get("enum", [sub["const"]] if "const" in sub else None)
            if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
                rules.append(f"v_{i}_{j}: " + " | ".join(_lark_str(c) for c in choices))  # written bare
            elif sub.get("type") == "string":  # bare text up to the closing tag (a pattern or format is not enforced)
                most = int(sub.get("maxLength", 256))
                least = int(sub.get("minLength", 1))
                rules.append(f"v_{i}_{j}: /[^<\\n]{{{least},{most}}}/")
            else:
                rules.append(f"v_{i}_{j}: {json_lark(sub)}")
            open_, close = self._param(key)
            parts.append(f"{lit(open_)} v_{i}_{j} {lit(close)}")
        head, tail = self._call_ends(name)
        return " ".join([lit(head), *parts, lit(tail)])

    def _param(self, key: str) -> tuple[str, str]:
        if self.name == "qwen-xml":
            return f"<parameter={key}>\n", "\n</parameter>\n"
        return f"<arg_key>{key}</arg_key>\n<arg_value>", "</arg_value>\n"

    def _call_ends(self, name: str) -> tuple[str, str]:
        if self.name == "qwen-xml":
            return f"<tool_call>\n<function={name}>\n", "</function>\n</tool_call>"
        return f"<tool_call>{name}\n", "</tool_call>"

    # --- the parse of a reply ------------------------------------------------------------------------------
    def parse(self, raw: str, tools: list[dict]) -> list[dict] | None:
        """OpenAI's ``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments"}}]``, the
        arguments a JSON text) of the calls in ``raw`` (the reply from the first of :attr:`starts` on, control tokens
        as their text), or None when it holds none that parse: then it is plain content."""
        names = {t["function"]["name"]: t["function"] for t in tools}
        calls: list[tuple[str, dict]] = []
        if self.name == "hermes":
            for m in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", raw, re.S):
                try:
                    obj = json.loads(m.group(1))
                except ValueError:
                    return None
                if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
                    return None
                args = obj.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        return None
                if not isinstance(args, dict):
                    return None
                calls.append((obj["name"], args))
        elif self.name == "harmony":
            pat = (r"to=functions\.([^\s<]+)\s*(?:<\|channel\|>)?\s*(?:commentary)?\s*(?:<\|constrain\|>)?\s*"
                   r"(?:json)?\s*<\|message\|>(.*?)(?:<\|call\|>|<\|end\|>|$)")
            for m in re.finditer(pat, raw, re.S):
                try:
                    args = json.loads(m.group(2))
                except ValueError:
                    return None
                if not isinstance(args, dict):
                    return None
                calls.append((m.group(1), args))
        else:
            if self.name == "qwen-xml":
                call_pat = r"<tool_call>\s*<function=([^>\n]+)>\s*(.*?)\s*</function>\s*(?:</tool_call>|$)"
                param_pat = r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>"
            else:
                call_pat = r"<tool_call>([^\n<]+)\s*(.*?)\s*(?:</tool_call>|$)"
                param_pat = r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>"
            for m in re.finditer(call_pat, raw, re.S):
                name = m.group(1).strip()
                props = ((names.get(name) or {}).get("parameters") or {}).get("properties") or {}
                args = {}
                for p in re.finditer(param_pat, m.group(2), re.S):
                    key, value = p.group(1).strip(), p.group(2)
                    args[key] = _xml_value(value, props.get(key))
                calls.append((name, args))
        if not calls:
            return None
        return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                 "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}} for n, a in calls]


def _xml_value(text: str, schema: object) -> object:
    """An XML-style argument value: a string where the schema says string (or the text is no JSON), else its JSON."""
    if isinstance(schema, dict) and (schema.get("type") == "string" or isinstance(schema.get("enum"), list)
                                     and all(isinstance(c, str) for c in schema["enum"])):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


FORMATS = {f.name: f for f in (ToolFormat("hermes", ("<tool_call>",)), ToolFormat("qwen-xml", ("<tool_call>",)),
                               ToolFormat("glm", ("<tool_call>",)),
                               ToolFormat("harmony", ("<|channel|>commentary to=", "to=functions.")))}


def reads_tools(source: str) -> bool:
    """Whether the Jinja template ``source`` reads the variable ``tools`` (so it can show a model its tools)."""
    import jinja2
    import jinja2.meta

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateSyntaxError:
        return "tools" in source
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def tool_format(source: str | None) -> ToolFormat:
    """The tool-call syntax of chat template ``source``; ToolFormatError saying why there is none."""
    if source is None:
        raise ToolFormatError("the model file has no chat template, so it cannot be shown tools")
    if not reads_tools(source):
        raise ToolFormatError("the chat template does not take tools (it never reads 'tools'), so the model "
                              "cannot be shown them")
    if "<|call|>" in source and "functions." in source:
        return FORMATS["harmony"]
    if "<function=" in source and "<parameter=" in source:
        return FORMATS["qwen-xml"]
    if "<arg_key>" in source and "<arg_value>" in source:
        return FORMATS["glm"]
    if "<tool_call>" in source and '"arguments"' in source:
        return FORMATS["hermes"]
    if "<|tool_call>" in source:
        raise ToolFormatError("the chat template's tool calls are Gemma 4's (<|tool_call>call:...), which moestream "
                              "cannot parse yet")
    raise ToolFormatError("the chat template takes tools, but its tool-call syntax is none moestream parses "
                          "(hermes <tool_call> JSON, Qwen 3.5 XML, GLM, gpt-oss harmony)")
