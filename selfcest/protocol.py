"""The spawn/return grammar between a model and the rollout engine.

Two spawn protocols share one interface and produce the same trees: `TokenProtocol` (dedicated
special tokens, for models that learn the protocol by SFT) and `ToolCallProtocol` (Hermes-style
tool calls through the chat template, as the paper's code uses with pretrained instruct models);
their docstrings give the grammar. `PlainProtocol` has no spawn grammar at all: flat generation,
for runs without clones (standard GRPO).

Parsing model output is total: any text gives spawn requests or a `ProtocolError` with a
reason the model is shown. Nothing is evaluated, nothing raises, nothing is dropped silently.

Text a model or a clone wrote (objectives, context, answers, error reasons) is injected as
plain text (`Protocol.encode_text`): spelling ``</return>`` or ``<|im_start|>`` never puts
that token into another node's context; only the framing carries special tokens.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from selfcest.budget import fair_shares
from selfcest.task import Task, context_block

ANSWER_MARKER = re.compile(r"answer\s*:", re.IGNORECASE)
TRUNCATION_MARKER = "…"
# An objective longer than this many characters is refused (keeps prompts and logs sane).
MAX_OBJECTIVE_CHARS = 4000
# Lone surrogates, and control characters but tab, newline and carriage return.
UNRENDERABLE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
# Stands in for untrusted text while the chat template renders the framing around it (the
# text itself never passes through the template, see `Protocol._framing`).
SLOT = "\x00SELFCEST\x00"


@dataclass(frozen=True)
class SpawnRequest:
    """One clone a parent asked for."""

    objective: str
    context_keys: tuple[str, ...] = ()
    max_tokens: int | None = None  # generation budget the parent asked for (engine clamps it)


@dataclass(frozen=True)
class ProtocolError:
    """A malformed spawn call: the reason is shown to the model and counted in metrics."""

    reason: str


@dataclass(frozen=True)
class CloneResult:
    """What comes back to the parent for one objective: an answer or an error."""

    answer: str | None = None
    error: str | None = None

    @property
    def text(self) -> str:
        return self.answer if self.error is None else f"error: {self.error}"


def extract_answer(text: str) -> str:
    """A node's final answer: what follows the last ``Answer:`` marker, else the last line.

    Only the first non-empty line after the marker is kept, so trailing chatter does not leak
    into the answer.
    """
    markers = list(ANSWER_MARKER.finditer(text))
    if markers:
        after = text[markers[-1].end() :]
        for line in after.splitlines():
            if line.strip():
                return line.strip()
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def resolve_keys(keys: Sequence[str], context: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """Map requested keys to context keys: exact match first, then case/space-insensitive.

    Returns (resolved keys, keys that matched nothing).
    """
    folded = {_fold(k): k for k in context}
    resolved, missing = [], []
    for key in keys:
        match = key if key in context else folded.get(_fold(key))
        (resolved if match is not None else missing).append(match if match is not None else key)
    return resolved, missing


def _fold(key: str) -> str:
    return " ".join(key.split()).casefold()


class Protocol(ABC):
    """How spawn calls are written, stopped on, parsed, and answered."""

    def __init__(
        self,
        tokenizer,
        root_system: str | None = None,
        clone_system: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.root_system = root_system
        self.clone_system = clone_system
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
            eos.add(im_end)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))

    # --------------------------------------------------------------- to subclass

    #: Its name in configs and saved policies (``model.protocol``).
    name: str
    #: Tokens this protocol needs as single (special) tokens of the vocabulary.
    required_tokens: tuple[str, ...] = ()
    #: Whether the grammar has spawn calls; without them no node ever spawns.
    has_spawn_calls: bool = True

    @property
    @abstractmethod
    def spawn_stop_id(self) -> int:
        """The token that closes a spawn call; the backend stops on it."""

    @property
    @abstractmethod
    def spawn_open_id(self) -> int:
        """The token that opens a spawn call."""

    @abstractmethod
    def parse_text(self, text: str) -> list[SpawnRequest] | ProtocolError:
        """Spawn requests from a turn that ended with the spawn-close token."""

    @abstractmethod
    def render_results(self, results: Sequence[CloneResult], max_tokens: int, per_clone: int):
        """Token ids injected after a spawn call, or None when even the framing does not fit.

        Each answer keeps at most ``per_clone`` tokens and all of them together fit in
        ``max_tokens`` (fair shares, see `budget.fair_shares`); a cut answer ends with a
        visible truncation marker.
        """

    @abstractmethod
    def _root_messages(self, task: Task) -> list[dict]: ...

    @abstractmethod
    def _clone_user(self, request: SpawnRequest, context: Mapping[str, str]) -> str:
        """A clone's user message: its objective and the context it asked for."""

    # --------------------------------------------------------------- shared

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.spawn_stop_id, *self.eos_token_ids)

    def root_prompt(self, task: Task, spawning: bool = True) -> list[int]:
        """The root's prompt; ``spawning`` says whether the root may spawn at all (a grammar
        that describes its call in the prompt leaves the description out when it may not)."""
        return self._template(self._root_messages(task))

    def clone_prompt(self, request: SpawnRequest, context: Mapping[str, str]) -> list[int]:
        """The chat template's framing around the user message, which is plain text: the
        objective is model-written, and context keys and values may spell special tokens too."""
        before, after = self._framing(_with_system(self.clone_system, SLOT), slots=1)
        user = self.encode_text(self._clone_user(request, context))
        return self.encode(before) + user + self.encode(after)

    def parse(self, token_ids: Sequence[int]) -> list[SpawnRequest] | ProtocolError:
        return self.parse_text(self.decode(token_ids))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """Trusted text (chat framing, task prompts, demonstrations): special-token text becomes
        the special token."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def final_text(self, token_ids: Sequence[int]) -> str:
        """A node's final turn as plain text: decoded without any special token of the
        tokenizer (every EOS style: ``<|im_end|>``, ``</s>``, ``<eos>``, ...).

        A turn that opens or closes a spawn call is a call, not an answer, and gives ""
        (a node cut off by its budget halfway through ``<spawn>compute 1+2<sep>the`` did not
        answer "the"; nor did one whose results no longer fit its context).
        """
        if self.spawn_open_id in token_ids or self.spawn_stop_id in token_ids:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def encode_text(self, text: str) -> list[int]:
        """Untrusted text (objectives, context, clone answers, error reasons) as plain text: no
        added token, special or not, is matched, so ``</return>`` stays characters.

        A Rust tokenizer's ``split_special_tokens`` still matches added tokens that are not
        special (Qwen2.5's ``</tool_call>``, the tool protocol's stop token), so its pipeline
        runs without the added vocabulary: normalizer, pre-tokenizer, model. A Python
        tokenizer that splits special tokens skips every added token already.
        """
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        words = [(text, None)]
        if backend.pre_tokenizer is not None:
            words = backend.pre_tokenizer.pre_tokenize_str(text)
        return [token.id for word, _ in words for token in backend.model.tokenize(word)]

    def _template(self, messages: list[dict], **kwargs) -> list[int]:
        """Trusted ``messages`` (a root prompt) through the chat template."""
        return self.encode(self._rendered(messages, **kwargs))

    def _rendered(self, messages: list[dict], **kwargs) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )

    def _framing(self, messages: list[dict], slots: int) -> list[str]:
        """The template's text for ``messages`` cut at each `SLOT`, where untrusted text goes.

        Untrusted text never passes through the template: callers encode these pieces with
        their special tokens, the text between them as plain text, and join the token ids
        (seams fall on newlines and special tokens, so ordinary text gets the ids of the
        whole text). A template that alters message content, and with it the slot, raises.
        """
        pieces = self._rendered(messages).split(SLOT)
        if len(pieces) != slots + 1:
            raise ValueError("the chat template does not render message content verbatim")
        return pieces

    def _truncated(self, results: Sequence[CloneResult], budget: int, per_clone: int):
        """Token ids of each result's text (plain text), cut to fair shares of ``budget``."""
        pieces = [self.encode_text(r.text) for r in results]
        keep = fair_shares([len(p) for p in pieces], budget, per_clone)
        marker = self.encode(TRUNCATION_MARKER)
        out = []
        for piece, n in zip(pieces, keep):
            if n < len(piece):
                piece = piece[: max(0, n - len(marker))] + marker[:n]
            out.append(piece)
        return out


class TokenProtocol(Protocol):
    """Spawn calls written with dedicated special tokens (for SFT-trained models).

    The model writes ``<spawn>objective<sep>objective</spawn>``; the backend stops on the single
    ``</spawn>`` token; the engine injects ``<return>answer<sep>answer</return>`` and the model
    continues. ``@KEY`` in an objective hands the task context under KEY to that clone; ``~N``
    at the end of an objective asks for a generation budget of N tokens.
    """

    SPAWN, SEP, END, RETURN, RETURN_END = "<spawn>", "<sep>", "</spawn>", "<return>", "</return>"
    name = "token"
    required_tokens = (SPAWN, SEP, END, RETURN, RETURN_END)
    KEY_REF = re.compile(r"@([A-Za-z0-9_][A-Za-z0-9_.\-]*)")
    BUDGET_REQ = re.compile(r"~\s*(\d{1,7})\s*$")

    def __init__(self, tokenizer, root_system: str | None = None, clone_system: str | None = None):
        super().__init__(tokenizer, root_system, clone_system)
        self.ids = {}
        for token in self.required_tokens:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
                raise ValueError(
                    f"tokenizer lacks the protocol token {token!r}: load the model with "
                    "ClonePolicy.from_pretrained(..., protocol='token'), which adds it"
                )
            self.ids[token] = token_id

    @property
    def spawn_stop_id(self) -> int:
        return self.ids[self.END]

    @property
    def spawn_open_id(self) -> int:
        return self.ids[self.SPAWN]

    def parse_text(self, text: str) -> list[SpawnRequest] | ProtocolError:
        end = text.rfind(self.END)
        if end < 0:
            return ProtocolError(f"no {self.END} closes the spawn call")
        start = text.rfind(self.SPAWN, 0, end)
        if start < 0:
            return ProtocolError(f"{self.END} without an opening {self.SPAWN}")
        body = text[start + len(self.SPAWN) : end]
        for token in (self.END, self.RETURN, self.RETURN_END):
            if token in body:
                return ProtocolError(f"unexpected {token} inside a spawn call")
        objectives = body.split(self.SEP)
        requests = []
        for n, raw in enumerate(objectives, 1):
            request = self._parse_objective(raw.strip())
            if isinstance(request, str):
                return ProtocolError(f"objective {n}: {request}")
            requests.append(request)
        return requests

    def _parse_objective(self, raw: str) -> SpawnRequest | str:
        max_tokens = None
        budget = self.BUDGET_REQ.search(raw)
        if budget:
            max_tokens = int(budget.group(1))
            raw = raw[: budget.start()].strip()
            if max_tokens < 1:
                return "a budget (~N) must be at least 1 token"
        if not raw:
            return "empty objective"
        if len(raw) > MAX_OBJECTIVE_CHARS:
            return f"objective longer than {MAX_OBJECTIVE_CHARS} characters"
        if problem := _unrenderable(raw):
            return problem
        keys = tuple(dict.fromkeys(self.KEY_REF.findall(raw)))
        return SpawnRequest(objective=raw, context_keys=keys, max_tokens=max_tokens)

    def render_results(self, results: Sequence[CloneResult], max_tokens: int, per_clone: int):
        framing = 2 + max(0, len(results) - 1)  # <return> ... <sep> ... </return>
        if max_tokens < framing:
            return None
        pieces = self._truncated(results, max_tokens - framing, per_clone)
        ids = [self.ids[self.RETURN]]
        for i, piece in enumerate(pieces):
            if i:
                ids.append(self.ids[self.SEP])
            ids.extend(piece)
        ids.append(self.ids[self.RETURN_END])
        return ids

    def _root_messages(self, task: Task) -> list[dict]:
        return _with_system(self.root_system, task.prompt)

    def _clone_user(self, request: SpawnRequest, context: Mapping[str, str]) -> str:
        keys, _ = resolve_keys(request.context_keys, context)
        user = request.objective
        if keys:
            user += "\n" + context_block(keys, context)
        return user


class ToolCallProtocol(Protocol):
    """Hermes-style ``<tool_call>`` JSON calling a ``spawn_clone`` tool (instruct models).

    The protocol: Hermes-style ``<tool_call>{"name": "spawn_clone", "arguments": ...}
    </tool_call>`` rendered through the chat template's tool support (with a fallback for
    templates without it); answers come back as a tool message. This is what the paper's code
    uses with pretrained instruct models.
    """

    CALL, CALL_END = "<tool_call>", "</tool_call>"
    name = "tool"
    required_tokens = (CALL, CALL_END)
    TOOL_NAME = "spawn_clone"
    EXAMPLE = '{"name": "spawn_clone", "arguments": {"objectives": ["...", "..."]}}'
    ARGUMENTS = ("objectives", "shared_context", "max_tokens")
    OBJECTIVE_FIELDS = ("objective", "shared_context", "max_tokens")
    SCHEMA = {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": (
                "Start clones of yourself, each in a fresh context, to work on independent "
                "objectives in parallel. Each clone reports back a short answer."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "objectives": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "One self-contained instruction per clone.",
                    },
                    "shared_context": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "Context keys whose text every clone receives.",
                    },
                    "max_tokens": {
                        "type": "integer",
                        "description": "Generation budget of each clone, in tokens.",
                    },
                },
                "required": ["objectives"],
            },
        },
    }
    DEFAULT_CLONE_SYSTEM = (
        "You are a clone spawned to solve one objective. Keep it short and end with "
        '"Answer: <answer>".'
    )

    def __init__(self, tokenizer, root_system: str | None = None, clone_system: str | None = None):
        super().__init__(tokenizer, root_system, clone_system or self.DEFAULT_CLONE_SYSTEM)
        self.open_id, self.call_id = (
            tokenizer.convert_tokens_to_ids(token) for token in (self.CALL, self.CALL_END)
        )
        for token, token_id in ((self.CALL, self.open_id), (self.CALL_END, self.call_id)):
            if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
                raise ValueError(
                    f"tokenizer lacks {token!r} as one token: load the model with "
                    "ClonePolicy.from_pretrained(..., protocol='tool'), which adds it"
                )
        template = tokenizer.chat_template or ""
        self.native_tools = "tools" in template

    @property
    def spawn_stop_id(self) -> int:
        return self.call_id

    @property
    def spawn_open_id(self) -> int:
        return self.open_id

    # --------------------------------------------------------------- prompts

    def _root_messages(self, task: Task) -> list[dict]:
        system = self.root_system or ""
        if not self.native_tools:
            system = (system + "\n\n" + self.tool_instructions()).strip()
        return _with_system(system or None, task.prompt)

    def _clone_user(self, request: SpawnRequest, context: Mapping[str, str]) -> str:
        # Clones see no tool schema; the engine still answers a call a clone makes (a clone
        # below max_depth may spawn, above it the call gets an error entry).
        keys, _ = resolve_keys(request.context_keys, context)
        user = request.objective
        if keys:
            user += "\n\nShared context:\n" + context_block(keys, context)
        return user

    def root_prompt(self, task: Task, spawning: bool = True) -> list[int]:
        """The root's prompt, with the tool described only to a root that may spawn: a root
        that may not (a monolithic run, ``max_depth=0``) sees the task as a plain chat turn
        and never learns of a tool it would only be refused."""
        if not spawning:
            return self._template(_with_system(self.root_system, task.prompt))
        if self.native_tools:
            return self._template(self._root_messages(task), tools=[self.SCHEMA])
        return self._template(self._root_messages(task))

    def tool_instructions(self) -> str:
        """The tool description for chat templates without native tool support.

        In words, not as the JSON schema (``SCHEMA``, which native templates render): every
        root prompt carries it, and the schema's ~210 tokens (SmolLM2's tokenizer) were 86% of
        a chain_sum root's prompt; these ~75 say the same.
        """
        return (
            "You may delegate with the tool spawn_clone: each objective goes to a fresh clone "
            "of you, which sees only that objective (and the shared_context keys you name) and "
            "returns a short answer. Optional: max_tokens, each clone's generation budget. "
            "Call it as\n"
            + f"{self.CALL}\n{self.EXAMPLE}\n{self.CALL_END}"
        )

    # --------------------------------------------------------------- parsing

    def parse_text(self, text: str) -> list[SpawnRequest] | ProtocolError:
        end = text.rfind(self.CALL_END)
        if end < 0:
            return ProtocolError(f"no {self.CALL_END} closes the tool call")
        start = text.rfind(self.CALL, 0, end)
        if start < 0:
            return ProtocolError(f"{self.CALL_END} without an opening {self.CALL}")
        body = text[start + len(self.CALL) : end].strip()
        if not body:
            # The error is all the model reads before it tries again: it shows the call's form
            # ("invalid JSON" at char 0 would not say what was missing).
            return ProtocolError(f"empty tool call; write {self.EXAMPLE} between the tags")
        payload = _loads(body)
        if isinstance(payload, ProtocolError):
            return payload
        if not isinstance(payload, dict):
            return ProtocolError('the tool call must be a JSON object {"name": ..., "arguments": '
                                 '...}')
        name = payload.get("name")
        if name != self.TOOL_NAME:
            return ProtocolError(f"unknown tool {name!r}; the only tool is {self.TOOL_NAME}")
        extra = sorted(set(payload) - {"name", "arguments"})
        if extra:
            return ProtocolError(f"unexpected field(s) {extra} in the tool call")
        arguments = payload.get("arguments")
        if isinstance(arguments, str):
            arguments = _loads(arguments)
            if isinstance(arguments, ProtocolError):
                return ProtocolError("arguments: " + arguments.reason)
        if not isinstance(arguments, dict):
            return ProtocolError("arguments must be a JSON object")
        unknown = sorted(set(arguments) - set(self.ARGUMENTS))
        if unknown:
            return ProtocolError(f"unknown argument(s) {unknown}; allowed: {list(self.ARGUMENTS)}")
        shared = _keys(arguments.get("shared_context"), "shared_context")
        budget = _budget(arguments.get("max_tokens"), "max_tokens")
        for problem in (shared, budget):
            if isinstance(problem, ProtocolError):
                return problem
        objectives = arguments.get("objectives")
        if isinstance(objectives, str):
            objectives = [objectives]
        if not isinstance(objectives, list) or not objectives:
            return ProtocolError("objectives must be a non-empty list of strings")
        requests = []
        for n, item in enumerate(objectives, 1):
            request = self._objective(item, shared, budget)
            if isinstance(request, ProtocolError):
                return ProtocolError(f"objective {n}: {request.reason}")
            requests.append(request)
        return requests

    def _objective(self, item, shared: tuple[str, ...], budget: int | None):
        if isinstance(item, dict):
            unknown = sorted(set(item) - set(self.OBJECTIVE_FIELDS))
            if unknown:
                return ProtocolError(f"unknown field(s) {unknown}")
            own_keys = _keys(item.get("shared_context"), "shared_context")
            own_budget = _budget(item.get("max_tokens"), "max_tokens")
            for problem in (own_keys, own_budget):
                if isinstance(problem, ProtocolError):
                    return problem
            text = item.get("objective")
            keys = tuple(dict.fromkeys(shared + own_keys))
            budget = own_budget if own_budget is not None else budget
        else:
            text, keys = item, shared
        if not isinstance(text, str):
            return ProtocolError("an objective must be a string")
        text = text.strip()
        if not text:
            return ProtocolError("empty objective")
        if len(text) > MAX_OBJECTIVE_CHARS:
            return ProtocolError(f"objective longer than {MAX_OBJECTIVE_CHARS} characters")
        if problem := _unrenderable(text):
            return ProtocolError(problem)
        return SpawnRequest(objective=text, context_keys=keys, max_tokens=budget)

    # --------------------------------------------------------------- returns

    def render_results(self, results: Sequence[CloneResult], max_tokens: int, per_clone: int):
        before, after = self._tool_turn()
        labels = [f"{i + 1}: " for i in range(len(results))]
        framing = len(before) + len(self.encode_text("\n".join(labels))) + len(after)
        budget = max_tokens - framing
        if budget < 0:
            return None
        # Re-encoding decoded pieces can merge tokens differently at the seams; shrink the
        # budget until the message fits (a few rounds at most).
        while budget >= 0:
            pieces = self._truncated(results, budget, per_clone)
            lines = [label + self.tokenizer.decode(p) for label, p in zip(labels, pieces)]
            ids = before + self.encode_text("\n".join(lines)) + after
            if len(ids) <= max_tokens:
                return ids
            budget -= len(ids) - max_tokens
        return None

    def _tool_turn(self) -> tuple[list[int], list[int]]:
        """Tokens before and after the answers: they close the assistant turn and open the tool
        message, then close it and reopen the assistant.

        Rendered by the chat template itself (the text after a placeholder assistant message),
        so whatever glue the template puts around tool messages is reproduced exactly, special
        tokens included. Templates without tool support get the answers as a user message in
        ``<tool_response>`` tags.
        """
        if self.native_tools:
            message = {"role": "tool", "content": SLOT}
        else:
            message = {"role": "user", "content": f"<tool_response>\n{SLOT}\n</tool_response>"}
        messages = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": SLOT},
            message,
        ]
        _, before, after = self._framing(messages, slots=2)
        return self.encode(before), self.encode(after)


class PlainProtocol(Protocol):
    """No spawn grammar: the root answers the task in a plain chat turn (for flat GRPO).

    The task as a chat turn, no added token, no node ever spawns: flat generation, for runs
    without clones (standard GRPO).

    It needs no token, so a model keeps the vocabulary it was loaded with; generation stops
    on EOS only, and no node spawns whatever the budget allows. What only a spawn grammar has
    (its tokens, rendering results, clone prompts) raises a `ValueError` that says so; parsing
    is total as for every protocol and gives a `ProtocolError`.
    """

    name = "none"
    has_spawn_calls = False

    @property
    def spawn_stop_id(self) -> int:
        raise _no_spawn_calls("spawn-close token")

    @property
    def spawn_open_id(self) -> int:
        raise _no_spawn_calls("spawn-open token")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.eos_token_ids

    def parse_text(self, text: str) -> ProtocolError:
        return ProtocolError("this protocol has no spawn calls")

    def render_results(self, results: Sequence[CloneResult], max_tokens: int, per_clone: int):
        raise _no_spawn_calls("clone results")

    def final_text(self, token_ids: Sequence[int]) -> str:
        """The turn decoded without special tokens: with no spawn grammar every turn is text."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _root_messages(self, task: Task) -> list[dict]:
        return _with_system(self.root_system, task.prompt)

    def _clone_user(self, request: SpawnRequest, context: Mapping[str, str]) -> str:
        raise _no_spawn_calls("clone prompts")


def _no_spawn_calls(what: str) -> ValueError:
    return ValueError(
        f"protocol 'none' has no spawn calls, so no {what}: load the policy with protocol "
        "'token' or 'tool' to delegate"
    )


def _with_system(system: str | None, user: str) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user}]


def _loads(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:
        return ProtocolError(f"invalid JSON ({str(error)[:120]})")


def _keys(value, name: str) -> tuple[str, ...] | ProtocolError:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return ProtocolError(f"{name} must be a list of context keys (strings)")
    for key in value:  # keys reach prompts too: in the error that names an unknown key
        if problem := _unrenderable(key):
            return ProtocolError(f"{name}: {problem}")
    return tuple(dict.fromkeys(v.strip() for v in value))


def _budget(value, name: str) -> int | None | ProtocolError:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return ProtocolError(f"{name} must be a positive integer")
    return value


def _unrenderable(text: str) -> str | None:
    """Why model-written ``text`` (an objective, a context key) cannot go into a prompt, or None.

    Refused: lone surrogates, which JSON escapes such as ``\\ud800`` decode to and no tokenizer
    encodes, and control characters other than tab, newline and carriage return (``\\u0000``
    and kin): they mean nothing in an objective or a key, and are what a malformed or
    adversarial call is made of. Special-token text such as ``<|im_start|>`` is allowed: it
    goes in as plain text (`Protocol.encode_text`). The reason names the code point, never
    the character, so the model can read it.
    """
    match = UNRENDERABLE.search(text)
    if match is None:
        return None
    return f"contains U+{ord(match.group()):04X} (a lone surrogate or control character)"
