"""Tool calls in a family's own syntax: which one a chat template uses, the grammar that makes a model write one
(``tool_choice`` ``"required"`` or a named function), and the parse of a reply back into OpenAI's ``tool_calls``.

The syntax is the one the template itself renders for an assistant message's ``tool_calls`` (so a call the model
writes is read back, and a call the client sends back is rendered, the same way):

- ``hermes`` (Qwen 3, Qwen 2.5, Hermes): ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``;
- ``qwen-xml`` (Qwen 3.5, Qwen3-Coder): ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>``;
- ``glm`` (GLM 4.5-4.7): ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>``;
- ``harmony`` (gpt-oss): ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`` ended by
  ``<|call|>`` (an end-of-generation token);
- ``gemma4`` (Gemma 4): ``<|tool_call>call:NAME{key:VALUE,...}<tool_call|>``, the keys in sorted order, a string
  value ``<|"|>text<|"|>``, numbers, ``true``/``false``/``null`` bare, lists ``[a,b]``, objects ``{key:value}``
  (keys bare or quoted): the values as the template's ``format_argument`` writes them.

Several calls in one reply (OpenAI's ``parallel_tool_calls``, true by default): ``hermes`` writes them one after
another, a newline between (as the Qwen 3 template renders an assistant's several calls), ``gemma4`` with nothing
between; the other syntaxes are parsed for several too, but a forced call there is one call.

In the XML styles a string value is written as it is, any other value as JSON (as the templates render them).
A template that never reads ``tools`` (DeepSeek R1's and V3.1's - V3.1 renders an assistant's calls but never
the tool list -, the embedded model's) cannot show a model its tools, and one whose syntax is none of these
(DeepSeek V3.2's and V4's DSML ``<｜DSML｜function_calls>``) cannot be parsed: :func:`tool_format` says why (the
server's 400).
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
          "<|constrain|>", "<|message|>", "<|tool_call>", "<tool_call|>", '<|"|>')

#: Gemma 4's string quote
GQ = '<|"|>'


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call syntax (see the module docstring). ``starts``: the texts that open a call in the
    model's output (control tokens as their text)."""

    name: str
    starts: tuple[str, ...]
    #: the text between two calls of one reply where a forced reply may hold several (None: one call only)
    sep: str | None = None

    def find(self, raw: str) -> int:
        """Where the first call begins in ``raw`` (-1: nowhere)."""
        found = [i for i in (raw.find(s) for s in self.starts) if i >= 0]
        return min(found, default=-1)

    # --- the grammar of one call to one of ``tools`` (OpenAI's function tools) -------------------------------
    def lark(self, tools: list[dict], control: dict[str, int] | None = None, many: bool = False) -> str:
        """A Lark grammar (llguidance's dialect) of one call to any of ``tools`` whose arguments follow the
        function's ``parameters`` schema (``many`` and a syntax with :attr:`sep`: one or more calls).
        ``control``: markup text -> id of the vocabulary's control token that spells it (written ``<[id]>``: a
        control token is never matched by text)."""
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
        one = " | ".join(alts)
        if many and self.sep is not None:
            rules.append(f"one: {one}")
            start = f"one ({lit(self.sep)} one)*" if self.sep else "one+"
        else:
            start = one
        return "start: " + start + "\n" + "\n".join(rules) + "\n"

    def _call_rule(self, name: str, schema: dict, i: int, rules: list[str], lit: Callable[[str], str]) -> str:
        if self.name == "hermes":
            rules.append(f"args_{i}: {json_lark(schema)}")
            return (lit('<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
                    + f" args_{i} " + lit("}\n</tool_call>"))
        if self.name == "harmony":
            rules.append(f"args_{i}: {json_lark(schema)}")
            return lit(f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>") + f" args_{i}"
        if self.name == "gemma4":
            return self._gemma_rule(name, schema, i, rules, lit)
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

    def _gemma_rule(self, name: str, schema: dict, i: int, rules: list[str], lit: Callable[[str], str]) -> str:
        """``<|tool_call>call:NAME{k:v,...}<tool_call|>``: the required properties in sorted order (the template's
        ``dictsort``), a scalar value as its schema allows, a list or object any Gemma value."""
        props = schema.get("properties") or {}
        required = sorted(k for k in schema.get("required") or [] if k in props)
        parts = []
        for j, key in enumerate(required):
            sub = props[key] if isinstance(props[key], dict) else {}
            choices = sub.get("enum", [sub["const"]] if "const" in sub else None)
            if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
                value = f"{lit(GQ)} ({' | '.join(_lark_str(c) for c in choices)}) {lit(GQ)}"
            elif sub.get("type") == "string":
                most, least = int(sub.get("maxLength", 256)), int(sub.get("minLength", 1))
                value = f"{lit(GQ)} /[^<\\n]{{{least},{most}}}/ {lit(GQ)}"
            elif sub.get("type") in ("integer", "number", "boolean", "null"):
                value = json_lark(sub)
            else:
                if not any(r.startswith("gv:") for r in rules):
                    rules.append(f"gv: {lit(GQ)} /[^<]*/ {lit(GQ)} | /-?[0-9]+(\\.[0-9]+)?([eE][-+]?[0-9]+)?/ | "
                                 '"true" | "false" | "null" | "[" (gv ("," gv)*)? "]" | '
                                 '"{" (gk ":" gv ("," gk ":" gv)*)? "}"')
                    rules.append("gk: /[A-Za-z_][A-Za-z0-9_]*/")
                value = "gv"
            rules.append(f"v_{i}_{j}: {value}")
            parts.append(("" if j == 0 else f"{lit(',')} ") + f"{lit(key + ':')} v_{i}_{j}")
        return " ".join([lit(f"<|tool_call>call:{name}{{"), *parts, lit("}<tool_call|>")])

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
        elif self.name == "gemma4":
            for m in re.finditer(r"<\|tool_call>call:([^{\s<]+)\{", raw):
                try:
                    args, _ = _gemma_value(raw, m.end() - 1)
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


def _gemma_value(text: str, i: int) -> tuple[object, int]:
    """The Gemma 4 value (``format_argument``'s writing) at ``text[i:]`` and where it ends; ValueError when there is
    none or it is cut short."""
    if text.startswith(GQ, i):
        end = text.find(GQ, i + len(GQ))
        if end < 0:
            raise ValueError("an unclosed string")
        return text[i + len(GQ):end], end + len(GQ)
    if i >= len(text):
        raise ValueError("cut short")
    c = text[i]
    if c in "{[":
        close, out, i = ("}" if c == "{" else "]"), ({} if c == "{" else []), i + 1
        while True:
            if i >= len(text):
                raise ValueError("cut short")
            if text[i] == close:
                return out, i + 1
            if out and text[i] == ",":
                i += 1
            if c == "[":
                v, i = _gemma_value(text, i)
                out.append(v)
                continue
            if text.startswith(GQ, i):  # a quoted key
                key, i = _gemma_value(text, i)
            else:
                m = re.compile(r"[^:{}\[\],<]+").match(text, i)
                if not m:
                    raise ValueError("no key")
                key, i = m.group().strip(), m.end()
            if not text.startswith(":", i):
                raise ValueError("no ':' after a key")
            out[key], i = _gemma_value(text, i + 1)
    m = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?|true|false|null").match(text, i)
    if not m:
        raise ValueError("no value")
    return json.loads(m.group()), m.end()


FORMATS = {f.name: f for f in (ToolFormat("hermes", ("<tool_call>",), "\n"), ToolFormat("qwen-xml", ("<tool_call>",)),
                               ToolFormat("glm", ("<tool_call>",)),
                               ToolFormat("harmony", ("<|channel|>commentary to=", "to=functions.")),
                               ToolFormat("gemma4", ("<|tool_call>",), ""))}


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
    if "<|tool_call>call:" in source and "<tool_call|>" in source:
        return FORMATS["gemma4"]
    raise ToolFormatError("the chat template takes tools, but its tool-call syntax is none moestream parses "
                          "(hermes <tool_call> JSON, Qwen 3.5 XML, GLM, gpt-oss harmony, Gemma 4)")
