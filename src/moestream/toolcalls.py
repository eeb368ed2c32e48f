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
  (keys bare or quoted): the values as the template's ``format_argument`` writes them;
- ``dsml`` (DeepSeek V3.2) and ``dsml-v4`` (DeepSeek V4): the calls of a reply in one block,
  ``\n\n<｜DSML｜function_calls>\n`` (V4: ``tool_calls``) ``<｜DSML｜invoke name="NAME">\n`` then per argument
  ``<｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>\n`` (``string="false"`` and JSON for a
  value that is no string), ``</｜DSML｜invoke>\n`` ... ``</｜DSML｜function_calls>`` (the bars are full-width).

Several calls in one reply (OpenAI's ``parallel_tool_calls``, true by default): ``hermes``, ``qwen-xml`` and ``glm``
write them one after another, a newline between (as the Qwen 3, Qwen 3.5 and GLM 4.6 templates render an
assistant's several calls), ``gemma4`` with nothing between, ``dsml`` as invokes one after another in the block.
``harmony`` is parsed for several too, but a forced reply there is one call: a harmony call message ends in
``<|call|>``, an end-of-generation token (the tool's answer comes before the model writes on), and the gpt-oss
template renders only the first call of an assistant message (``message.tool_calls[0]``), so a second call could
not be sent back.

In the XML styles and DSML a string value is written as it is, any other value as JSON (as the templates render
them). A template that never reads ``tools`` (DeepSeek R1's and V3.1's - V3.1 renders an assistant's calls but never
the tool list -, the embedded model's) cannot show a model its tools, and one whose syntax is none of these cannot
be parsed: :func:`tool_format` says why (the server's 400).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from .structured import GrammarError, json_lark


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

#: DeepSeek's DSML prefix of its tool-call markup (full-width bars)
DSML = "\uff5cDSML\uff5c"


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call syntax (see the module docstring). ``starts``: the texts that open a call in the
    model's output (control tokens as their text)."""

    name: str
    starts: tuple[str, ...]
    #: the text between two calls of one reply where a forced reply may hold several (None: one call only)
    sep: str | None = None
    #: the text before and after a reply's calls where the syntax puts them in one block (DSML), else None
    wrap: tuple[str, str] | None = None

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
        if self.wrap is not None:
            start = f"{lit(self.wrap[0])} ({start}) {lit(self.wrap[1])}"
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
        # the XML styles (and DSML): one element per property, the required ones first, in the schema's order
        props = schema.get("properties") or {}
        required = [k for k in schema.get("required") or [] if k in props]
        parts = []
        for j, key in enumerate(required):
            sub = props[key] if isinstance(props[key], dict) else {}
            choices = sub.get("enum", [sub["const"]] if "const" in sub else None)
            bare = True
            if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
                rules.append(f"v_{i}_{j}: " + " | ".join(_lark_str(c) for c in choices))  # written bare
            elif sub.get("type") == "string":  # bare text up to the closing tag (a pattern or format is not enforced)
                most = int(sub.get("maxLength", 256))
                least = int(sub.get("minLength", 1))
                rules.append(f"v_{i}_{j}: /[^<\\n]{{{least},{most}}}/")
            else:
                rules.append(f"v_{i}_{j}: {json_lark(sub)}")
                bare = False
            open_, close = self._param(key, bare)
            parts.append(f"{lit(open_)} v_{i}_{j} {lit(close)}")
        head, tail = self._call_ends(name)
        if not parts and self.name == "dsml-v4":  # V4's template writes a newline into an invoke without arguments
            tail = "\n" + tail
        return " ".join([lit(head), *parts, lit(tail)])

    def _gemma_rule(self, name: str, schema: dict, i: int, rules: list[str], lit: Callable[[str], str]) -> str:
        """``<|tool_call>call:NAME{k:v,...}<tool_call|>``: the required properties in sorted order (the template's
        ``dictsort``), each value as its schema allows (:class:`_GemmaSchema`: lists and objects too)."""
        values = _GemmaSchema(schema, f"g{i}", rules, lit)
        return " ".join([lit(f"<|tool_call>call:{name}{{"), values.members(schema, required_only=True),
                         lit("}<tool_call|>")])

    def _param(self, key: str, bare: bool) -> tuple[str, str]:
        """The markup before and after an argument's value (``bare``: a string written as it is, not JSON)."""
        if self.name == "qwen-xml":
            return f"<parameter={key}>\n", "\n</parameter>\n"
        if self.name.startswith("dsml"):
            return f'<{DSML}parameter name="{key}" string="{"true" if bare else "false"}">', f"</{DSML}parameter>\n"
        return f"<arg_key>{key}</arg_key>\n<arg_value>", "</arg_value>\n"

    def _call_ends(self, name: str) -> tuple[str, str]:
        if self.name == "qwen-xml":
            return f"<tool_call>\n<function={name}>\n", "</function>\n</tool_call>"
        if self.name.startswith("dsml"):
            return f'<{DSML}invoke name="{name}">\n', f"</{DSML}invoke>\n"
        return f"<tool_call>{name}\n", "</tool_call>"

    # --- the parse of a reply ------------------------------------------------------------------------------
    def parse(self, raw: str, tools: list[dict], cut: bool = False) -> list[dict] | None:
        """OpenAI's ``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments"}}]``, the
        arguments a JSON text) of the calls in ``raw`` (the reply from the first of :attr:`starts` on, control tokens
        as their text), or None when it holds none that parse: then it is plain content.

        ``cut``: the reply was cut short (``max_tokens``, a full context): the calls up to the first that is not
        complete (its arguments not written to their end: the JSON object or Gemma 4's braces unclosed, the XML
        styles' closing ``</function>`` / ``</tool_call>`` missing) are returned, possibly none (an empty list),
        and the rest is dropped."""
        names = {t["function"]["name"]: t["function"] for t in tools}
        calls: list[tuple[str, dict]] = []
        if self.name == "hermes":
            for m in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", raw, re.S):
                try:
                    obj = json.loads(m.group(1))
                except ValueError:
                    obj = None
                args = obj.get("arguments", {}) if isinstance(obj, dict) and isinstance(obj.get("name"), str) else None
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        args = None
                if not isinstance(args, dict):
                    break
                calls.append((obj["name"], args))
            else:
                return self._calls(calls, cut)
        elif self.name == "harmony":
            pat = (r"to=functions\.([^\s<]+)\s*(?:<\|channel\|>)?\s*(?:commentary)?\s*(?:<\|constrain\|>)?\s*"
                   r"(?:json)?\s*<\|message\|>(.*?)(?:<\|call\|>|<\|end\|>|$)")
            for m in re.finditer(pat, raw, re.S):
                try:
                    args = json.loads(m.group(2))
                except ValueError:
                    break
                if not isinstance(args, dict):
                    break
                calls.append((m.group(1), args))
            else:
                return self._calls(calls, cut)
        elif self.name == "gemma4":
            for m in re.finditer(r"<\|tool_call>call:([^{\s<]+)\{", raw):
                try:
                    args, _ = _gemma_value(raw, m.end() - 1)
                except ValueError:
                    break
                if not isinstance(args, dict):
                    break
                calls.append((m.group(1), args))
            else:
                return self._calls(calls, cut)
        elif self.name.startswith("dsml"):
            for m in re.finditer(f'<{DSML}invoke name="([^"\\n]+)">\\n?(.*?)(</{DSML}invoke>|$)', raw, re.S):
                if cut and not m.group(3):  # no closing tag: more arguments may have followed
                    break
                args = {}
                param_pat = f'<{DSML}parameter name="([^"\\n]+)" string="(true|false)">(.*?)</{DSML}parameter>'
                for p in re.finditer(param_pat, m.group(2), re.S):
                    args[p.group(1)] = _xml_value(p.group(3), {"type": "string"} if p.group(2) == "true" else None)
                calls.append((m.group(1), args))
            return self._calls(calls, cut)
        else:
            if self.name == "qwen-xml":
                call_pat = r"<tool_call>\s*<function=([^>\n]+)>\s*(.*?)\s*</function>\s*(?:</tool_call>|$)"
                param_pat = r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>"
            else:
                call_pat = r"<tool_call>([^\n<]+)\s*(.*?)\s*(</tool_call>|$)"
                param_pat = r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>"
            for m in re.finditer(call_pat, raw, re.S):
                if cut and self.name == "glm" and not m.group(3):  # no closing tag: more arguments may have followed
                    break
                name = m.group(1).strip()
                props = ((names.get(name) or {}).get("parameters") or {}).get("properties") or {}
                args = {}
                for p in re.finditer(param_pat, m.group(2), re.S):
                    key, value = p.group(1).strip(), p.group(2)
                    args[key] = _xml_value(value, props.get(key))
                calls.append((name, args))
            return self._calls(calls, cut)
        # a call that did not parse: the whole reply is content, unless it was cut (then it is the cut-off tail)
        return self._calls(calls, cut) if cut else None

    @staticmethod
    def _calls(calls: list[tuple[str, dict]], cut: bool) -> list[dict] | None:
        """OpenAI's ``tool_calls`` of ``(name, arguments)`` pairs, each with a new id; None for none (``cut``: [])."""
        if not calls:
            return [] if cut else None
        return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                 "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}} for n, a in calls]


#: JSON-schema keywords a Gemma 4 grammar cannot enforce (a forced call with them is refused, not left unchecked)
GEMMA_UNSUPPORTED = ("allOf", "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
                     "prefixItems", "minProperties", "maxProperties", "dependentRequired", "dependentSchemas",
                     "propertyNames", "patternProperties", "unevaluatedItems", "unevaluatedProperties")

#: the JSON-schema keywords of a number that llguidance's ``%json`` enforces (Gemma 4 writes numbers as JSON does)
_NUMBER_KEYS = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


class _GemmaSchema:
    """Lark rules (llguidance's dialect) of Gemma 4 values, as the template's ``format_argument`` writes a call's
    arguments (``escape_keys=False``), that follow a JSON schema: a string ``<|"|>text<|"|>`` (``enum``,
    ``const``, ``minLength``, ``maxLength``; no ``<`` or newline in it, and a ``pattern`` or ``format`` is not
    enforced), a number or integer bare (its bounds by llguidance's JSON), ``true``/``false``, ``null``, a list
    ``[a,b]`` (``items``, ``minItems``, ``maxItems``), an object ``{key:value,...}`` with bare keys in sorted order
    (the template's ``dictsort``): its ``required`` properties always, its other declared ones where the model
    writes them, no others; ``anyOf``/``oneOf`` and a list of types as alternatives, a local ``$ref``
    (``#/$defs/NAME``) as a rule of its own; a schema without ``type``, ``enum`` or structure allows any Gemma value.
    Keywords of :data:`GEMMA_UNSUPPORTED` raise GrammarError.

    ``root``: the function's ``parameters`` (what a ``$ref`` points into); ``prefix``: the rules' names' prefix;
    ``rules``: where new rules are appended; ``lit``: a Lark literal of markup text (control tokens by id)."""

    def __init__(self, root: dict, prefix: str, rules: list[str], lit: Callable[[str], str]):
        self.root, self.prefix, self.rules, self.lit = root, prefix, rules, lit
        self.n = 0
        self.refs: dict[str, str] = {}

    def _rule(self, body: str | None = None) -> str:
        """A new rule's name (with ``body``: appended now; else the caller appends it)."""
        self.n += 1
        name = f"{self.prefix}_{self.n}"
        if body is not None:
            self.rules.append(f"{name}: {body}")
        return name

    def _any(self) -> str:
        """Any Gemma value (the rule ``gv``, added once per grammar)."""
        if not any(r.startswith("gv:") for r in self.rules):
            q = self.lit(GQ)
            self.rules.append(f"gv: {q} /[^<]*/ {q} | /-?[0-9]+(\\.[0-9]+)?([eE][-+]?[0-9]+)?/ | "
                              '"true" | "false" | "null" | "[" (gv ("," gv)*)? "]" | '
                              '"{" (gk ":" gv ("," gk ":" gv)*)? "}"')
            self.rules.append("gk: /[A-Za-z_][A-Za-z0-9_]*/")
        return "gv"

    def _literal(self, value: object) -> str:
        """A Lark expression of one enum or const value written as the template writes it."""
        if isinstance(value, str):
            return f"{self.lit(GQ)} {_lark_str(value)} {self.lit(GQ)}"
        if isinstance(value, bool) or value is None or isinstance(value, (int, float)):
            return _lark_str(json.dumps(value))
        if isinstance(value, list):
            parts = [_lark_str("[")]
            for k, v in enumerate(value):
                parts += ([_lark_str(",")] if k else []) + [self._literal(v)]
            return " ".join([*parts, _lark_str("]")])
        if isinstance(value, dict):
            parts = [_lark_str("{")]
            for k, (key, v) in enumerate(sorted(value.items())):
                parts += ([_lark_str(",")] if k else []) + [_lark_str(f"{key}:"), self._literal(v)]
            return " ".join([*parts, _lark_str("}")])
        raise GrammarError(f"an enum or const value {json.dumps(value)[:60]} is no JSON value")

    def value(self, schema: object) -> str:
        """A Lark expression of the Gemma values that ``schema`` allows."""
        if schema is True or schema == {}:
            return self._any()
        if schema is False:
            raise GrammarError("a schema of false allows no value")
        if not isinstance(schema, dict):
            raise GrammarError(f"a schema must be an object, got {json.dumps(schema)[:60]}")
        bad = [k for k in GEMMA_UNSUPPORTED if k in schema]
        if bad:
            raise GrammarError(f"Gemma 4's call syntax: the grammar cannot enforce '{bad[0]}'")
        if "$ref" in schema:
            return self._ref(schema["$ref"])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                subs = schema[key]
                if not isinstance(subs, list) or not subs:
                    raise GrammarError(f"'{key}' must be a non-empty list of schemas")
                base = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
                return "(" + " | ".join(self.value({**base, **s} if isinstance(s, dict) else s) for s in subs) + ")"
        if "const" in schema or "enum" in schema:
            choices = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(choices, list) or not choices:
                raise GrammarError("'enum' must be a non-empty list")
            return "(" + " | ".join(self._literal(c) for c in choices) + ")"
        kind = schema.get("type")
        if isinstance(kind, list):
            if not kind:
                raise GrammarError("'type' must not be an empty list")
            return "(" + " | ".join(self.value({**schema, "type": t}) for t in kind) + ")"
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
        if kind == "string":
            most, least = int(schema.get("maxLength", 256)), int(schema.get("minLength", 1))
            return f"{self.lit(GQ)} /[^<\\n]{{{least},{most}}}/ {self.lit(GQ)}"
        if kind in ("integer", "number"):
            return json_lark({k: schema[k] for k in _NUMBER_KEYS if k in schema})
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind == "array":
            return self._array(schema)
        if kind == "object":
            return " ".join([_lark_str("{"), self.members(schema), _lark_str("}")])
        if kind is None:
            return self._any()
        raise GrammarError(f"unknown type {json.dumps(kind)[:40]}")

    def _ref(self, ref: object) -> str:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise GrammarError(f"only a local '$ref' (#/...) is enforced, got {json.dumps(ref)[:60]}")
        if ref not in self.refs:
            target: object = self.root
            for part in filter(None, ref[1:].split("/")):
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or part not in target:
                    raise GrammarError(f"'$ref' {ref[:60]} points nowhere")
                target = target[part]
            name = self.refs[ref] = self._rule()
            self.rules.append(f"{name}: {self.value(target)}")  # named first: a schema may refer to itself
        return self.refs[ref]

    def _array(self, schema: dict) -> str:
        item = self._rule(self.value(schema.get("items", True)))
        least, most = int(schema.get("minItems", 0)), schema.get("maxItems")
        if most is not None and int(most) < least:
            raise GrammarError("'maxItems' is below 'minItems'")
        if most is not None and int(most) == 0:
            return _lark_str("[]")
        rest = f"{{{max(least - 1, 0)},{'' if most is None else int(most) - 1}}}"
        body = f'{item} ("," {item}){rest}'
        return f'"[" {body} "]"' if least >= 1 else f'"[" ({body})? "]"'

    def members(self, schema: dict, required_only: bool = False) -> str:
        """The ``key:value,...`` inside an object's braces: ``required`` always, each other declared property
        optional (none with ``required_only``), in sorted order; any members when it declares none and allows
        others."""
        props = schema.get("properties")
        if props is None:
            if schema.get("additionalProperties", True) is False or required_only:
                return '""'
            self._any()
            return '(gk ":" gv ("," gk ":" gv)*)?'
        if not isinstance(props, dict):
            raise GrammarError("'properties' must be an object")
        required = set(schema.get("required") or [])
        missing = sorted(required - set(props))
        if missing:
            raise GrammarError(f"'{missing[0]}' is required but not a declared property")
        keys = [k for k in sorted(props) if k in required or not required_only]
        # after[j]: members j.. after one was written; first[j]: members j.. before any (one rule each)
        after, first = ['""'], ['""']
        for key in reversed(keys):
            pair = f"{self.lit(key + ':')} {self._rule(self.value(props[key]))}"
            more, start = after[-1], first[-1]
            if key in required:
                after.append(self._rule(f'"," {pair} {more}'))
                first.append(self._rule(f"{pair} {more}"))
            else:
                after.append(self._rule(f'("," {pair})? {more}'))
                first.append(self._rule(f"{pair} {more} | {start}"))
        return first[-1]


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


FORMATS = {f.name: f for f in (ToolFormat("hermes", ("<tool_call>",), "\n"),
                               ToolFormat("qwen-xml", ("<tool_call>",), "\n"),
                               ToolFormat("glm", ("<tool_call>",), "\n"),
                               ToolFormat("harmony", ("<|channel|>commentary to=", "to=functions.")),
                               ToolFormat("gemma4", ("<|tool_call>",), ""),
                               *(ToolFormat(name, (f"<{DSML}{b}>",), "", (f"\n\n<{DSML}{b}>\n", f"</{DSML}{b}>"))
                                 for name, b in (("dsml", "function_calls"), ("dsml-v4", "tool_calls"))))}


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
    if "\uff5cDSML\uff5c" in source and "invoke name=" in source:
        return FORMATS["dsml" if "function_calls>" in source else "dsml-v4"]
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
                          "(hermes <tool_call> JSON, Qwen 3.5 XML, GLM, gpt-oss harmony, Gemma 4, DeepSeek DSML)")
