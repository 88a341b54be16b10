"""RolloutEngine: expands every clone tree of a batch at once, asynchronously.

Each node is one coroutine. It generates until the spawn-close token, EOS or a budget; on a
spawn call it starts its clones as concurrent coroutines, waits for all of them, injects
their answers and resumes. All nodes of all trees are in flight together, so the backend
sees (and batches) every branch that is waiting for tokens at the same moment. Where no node
may spawn (the budget or the protocol rules it out), generation does not stop on the
spawn-close token: a node writes its turn in one call.

Budgets are enforced before each backend call (see `selfcest.budget`); every way a spawn
can fail (malformed call, depth, rounds, clone caps, unknown context keys, an overlong clone
prompt, an exhausted pool, a crashed clone, a prompt or result that does not render) becomes
an error entry the parent reads, never an exception that takes the batch down.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from selfcest.budget import Allowance, Budget, clone_allowance, clone_pools
from selfcest.protocol import (
    CloneResult,
    Protocol,
    ProtocolError,
    SpawnRequest,
    extract_answer,
    resolve_keys,
)
from selfcest.rollout.backends.base import Backend, Completion, SamplingParams
from selfcest.task import Task
from selfcest.tree import CloneTree, Node, Segment, Spawn


@dataclass
class _TreeRun:
    """Mutable bookkeeping of one tree while it is being expanded."""

    tree: CloneTree
    task: Task
    clones: int = 0
    # Mixed into every sampling seed, so re-runs of a tree draw fresh samples.
    salt: str = ""


NULL_RESULT = CloneResult(error="no result")


class RolloutEngine:
    """Samples clone trees for tasks through a `Backend`, under a `Budget`."""

    def __init__(
        self,
        backend: Backend,
        protocol: Protocol,
        budget: Budget | None = None,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        call_timeout_s: float | None = None,
        root_prefill: Sequence[int] = (),
    ) -> None:
        """``root_prefill``: token ids every root's first turn starts with, as if it had
        written them (a ``prefill`` segment, masked out of training). The spawn-open token
        forces every root to delegate: how a forced style is evaluated."""
        self.backend = backend
        self.protocol = protocol
        self.budget = budget or Budget()
        self.sampling = sampling or SamplingParams()
        self.seed = seed
        self.call_timeout_s = call_timeout_s
        self.root_prefill = list(root_prefill)

    def rollout(self, tasks: Sequence[Task], samples_per_task: int = 1) -> list[CloneTree]:
        """Sample ``samples_per_task`` trees per task; trees come back grouped by task.

        Works inside a running event loop too (a notebook): the rollout then runs on a
        worker thread with its own loop.
        """
        return _run_sync(self.arollout(tasks, samples_per_task))

    async def arollout(self, tasks: Sequence[Task], samples_per_task: int = 1) -> list[CloneTree]:
        runs = [
            self._new_run(task, task_index, sample)
            for task_index, task in enumerate(tasks)
            for sample in range(samples_per_task)
        ]
        await asyncio.gather(*(self._run_root(run) for run in runs))
        return [run.tree for run in runs]

    def rerun_without(self, tree: CloneTree, task: Task, clone_id: str,
                      samples: int) -> list[CloneTree]:
        """Counterfactual re-runs: the root resumes from the spawn call that started
        ``clone_id`` (a depth-1 clone), reading a null result in its place, ``samples`` times.

        Everything before the spawn point is kept as it was (the root's tokens, the other
        clones of that wave and of earlier waves); what follows is sampled afresh.
        """
        return _run_sync(self._rerun_without(tree, task, clone_id, samples))

    async def _rerun_without(self, tree, task, clone_id, samples) -> list[CloneTree]:
        clone = tree.nodes[clone_id]
        if clone.parent_id != CloneTree.ROOT_ID:
            raise ValueError(f"counterfactual re-runs replace depth-1 clones; {clone_id} is deeper")
        wave = next(w for w, spawn in enumerate(tree.root.spawns) if clone_id in spawn.child_ids)
        copies, runs = [], []
        for k in range(samples):
            copy = CloneTree.from_dict(tree.to_dict())
            copy.reward = copy.correct = copy.node_rewards = None
            copy.info = {"counterfactual_of": clone_id}
            root = copy.root
            spawn = root.spawns[wave]
            root.segments = root.segments[: spawn.segment_index + 1]
            root.spawns = root.spawns[: wave + 1]
            kept = [c for s in root.spawns for c in s.child_ids]
            copy.nodes = {
                n: node for n, node in copy.nodes.items()
                if n == CloneTree.ROOT_ID or any(n == c or n.startswith(c + ".") for c in kept)
            }
            root.finish_reason, root.error = "running", None
            root.final_text = root.answer = ""
            allowance = Allowance(cap=self.budget.node_generation, pool=self.budget.tree_generation,
                                  own=root.generated_tokens,
                                  descendants=sum(n.generated_tokens for n in copy.clones()))
            run = _TreeRun(tree=copy, task=task, clones=len(copy.clones()),
                           salt=f"cf:{clone_id}:{k}")
            copies.append(copy)
            runs.append(self._run_node(run, root, allowance, self._results(copy, spawn, clone_id)))
        await asyncio.gather(*runs)
        return copies

    # ------------------------------------------------------------------ tree level

    def _new_run(self, task: Task, task_index: int, sample: int) -> _TreeRun:
        tree = CloneTree(task_id=task.id, task_index=task_index, sample_index=sample)
        return _TreeRun(tree=tree, task=task)

    async def _run_root(self, run: _TreeRun) -> None:
        budget = self.budget
        root = run.tree.add(
            Node(id=CloneTree.ROOT_ID, parent_id=None, depth=0, objective=None,
                 prompt_ids=self.protocol.root_prompt(run.task, spawning=self.spawning))
        )
        allowance = Allowance(cap=budget.node_generation, pool=budget.tree_generation)
        if len(root.prompt_ids) >= budget.node_context:
            root.finish_reason = "error"
            root.error = (
                f"root prompt of {len(root.prompt_ids)} tokens does not fit the context budget "
                f"(budget.node_context = {budget.node_context})"
            )
            return
        if self.root_prefill:
            root.segments.append(Segment("prefill", list(self.root_prefill), None,
                                         self.protocol.decode(self.root_prefill)))
        await self._run_node(run, root, allowance)

    # ------------------------------------------------------------------ node level

    async def _run_node(
        self,
        run: _TreeRun,
        node: Node,
        allowance: Allowance,
        pending: list[CloneResult] | None = None,
    ) -> None:
        """Generate, spawn and resume until the node ends; never raises (but on cancel).

        ``pending`` results are injected first: a node resumed right after a spawn call.
        """
        if node.generation_budget is None:
            node.generation_budget = allowance.cap
        calls = sum(1 for segment in node.segments if segment.trainable)
        try:
            if pending is not None:
                self._inject(node, pending, kind="return")
            while node.finish_reason == "running":
                max_tokens = allowance.max_tokens(node.context_length, self.budget.node_context)
                if max_tokens == 0:
                    node.finish_reason = "budget"
                    break
                completion = await self._generate(run, node, calls, max_tokens)
                calls += 1
                allowance.spend(len(completion.token_ids))
                self._check_version(run.tree, node, completion)
                node.segments.append(
                    Segment("sampled", list(completion.token_ids), list(completion.logprobs),
                            self.protocol.decode(completion.token_ids))
                )
                ends_call = (
                    self.spawning
                    and completion.finish_reason == "stop"
                    and completion.token_ids[-1] == self.protocol.spawn_stop_id
                )
                if not ends_call:
                    node.finish_reason = "eos" if completion.finish_reason == "stop" else "budget"
                    break
                await self._spawn(run, node, allowance)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a failing backend call fails this node, not the batch
            node.finish_reason = "error"
            node.error = f"{type(error).__name__}: {error}"[:300]
        node.final_text = self.protocol.final_text(self._turn(node))
        node.answer = extract_answer(node.final_text)

    async def _generate(self, run: _TreeRun, node: Node, call: int, max_tokens: int):
        request = self.backend.generate(
            node.context_ids(),
            max_tokens=max_tokens,
            stop_token_ids=self._stop_token_ids(),
            sampling=self.sampling,
            seed=self._seed(run, node.id, call),
            # A node that stops on its spawn call resumes with the clones' answers appended.
            resume_token_ids=(self.protocol.spawn_stop_id,) if self.spawning else (),
        )
        if self.call_timeout_s is None:
            return await request
        return await asyncio.wait_for(request, self.call_timeout_s)

    @property
    def spawning(self) -> bool:
        """Whether a node may spawn at all: the budget allows it and the protocol has calls."""
        return self.budget.spawning and self.protocol.has_spawn_calls

    def _stop_token_ids(self) -> tuple[int, ...]:
        """What ends a generation call: EOS, and the spawn-close token where spawning is on.

        Where no node may spawn, a call would only earn a notice and a second, small decode
        batch to continue after it; the node writes on instead, and a turn that holds a spawn
        call is no answer (`Protocol.final_text`). A clone at the maximum depth of a tree that
        spawns still stops: the depth notice is what it learns its limit from.
        """
        if self.spawning:
            return self.protocol.stop_token_ids
        return self.protocol.eos_token_ids

    def _seed(self, run: _TreeRun, node_id: str, call: int) -> int:
        """A per-call seed that does not depend on what else the backend batches with it."""
        tree = run.tree
        key = (f"{self.seed}:{tree.task_index}:{tree.sample_index}:{node_id}:{call}:"
               f"{run.salt}").encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1

    @staticmethod
    def _check_version(tree: CloneTree, node: Node, completion: Completion) -> None:
        """A tree never mixes weight versions: a completion sampled under other weights fails
        its node, and its tokens are counted as the tree's discarded tokens."""
        version = completion.weight_version
        if tree.weight_version is None:
            tree.weight_version = version
        if version != tree.weight_version:
            tree.discarded_tokens += len(completion.token_ids)
            raise RuntimeError(
                f"weights changed during the rollout (version {tree.weight_version} -> {version})"
            )
        node.weight_version = version

    @staticmethod
    def _turn(node: Node) -> list[int]:
        """The node's current turn: its tokens after the last injected result or notice
        (sampled tokens, and a prefill the turn started with)."""
        turn: list[int] = []
        for segment in node.segments:
            turn = [] if segment.kind in ("return", "notice") else turn + segment.token_ids
        return turn

    # ------------------------------------------------------------------ spawning

    async def _spawn(self, run: _TreeRun, node: Node, allowance: Allowance) -> None:
        """Handle the spawn call that ends the node's last segment, then inject the results."""
        spawn = Spawn(segment_index=len(node.segments) - 1, child_ids=[])
        node.spawns.append(spawn)
        parsed = self.protocol.parse(self._turn(node))
        if isinstance(parsed, ProtocolError):
            spawn.errors.append(parsed.reason)
            spawn.slots.append("")
            self._inject(node, [CloneResult(error=parsed.reason)], kind="notice")
            return
        verdicts = self._admit(run, node, parsed)
        accepted = [(i, req, prompt) for i, (req, prompt, error) in enumerate(verdicts)
                    if not error]
        pools = clone_pools(allowance.pool_left, [req.max_tokens for _, req, _ in accepted],
                            own_left=allowance.cap - allowance.own)
        refusals = [error for _, _, error in verdicts]
        children = []
        for (i, request, prompt), pool in zip(accepted, pools):
            if pool < 1:
                refusals[i] = "the tree's generation budget is exhausted"
                continue
            child = run.tree.add(
                Node(id=f"{node.id}.{len(node.children)}", parent_id=node.id,
                     depth=node.depth + 1, objective=request.objective, prompt_ids=prompt,
                     context_keys=resolve_keys(request.context_keys, run.task.context)[0])
            )
            spawn.child_ids.append(child.id)
            child_allowance = clone_allowance(pool, request.max_tokens, self.budget.clone_cap)
            run.clones += 1
            children.append((i, child, pool, child_allowance))
        child_at = {i: child for i, child, _, _ in children}
        for i, refusal in enumerate(refusals):
            spawn.slots.append(child_at[i].id if i in child_at else "")
            if i not in child_at:
                spawn.errors.append(refusal)
        allowance.lend([pool for _, _, pool, _ in children])
        await asyncio.gather(*(self._run_node(run, c, a) for _, c, _, a in children))
        for _, child, pool, child_allowance in children:
            allowance.settle(pool, child_allowance)
        self._inject(node, self._results(run.tree, spawn), kind="return")

    def _results(self, tree: CloneTree, spawn: Spawn, nulled: str
                 | None = None) -> list[CloneResult]:
        """What the parent reads after ``spawn``, in objective order (``nulled``: that clone's
        answer replaced by a null result)."""
        errors = iter(spawn.errors)
        results = []
        for slot in spawn.slots:
            if not slot:
                results.append(CloneResult(error=next(errors)))
            elif slot == nulled:
                results.append(NULL_RESULT)
            else:
                results.append(self._result_of(tree.nodes[slot]))
        return results

    def _admit(self, run: _TreeRun, node: Node, requests: list[SpawnRequest]):
        """Pair each request with its clone prompt, or with the reason it is refused."""
        budget = self.budget
        if node.depth >= budget.max_depth:
            reason = f"maximum clone depth {budget.max_depth} reached"
            return [(req, None, reason) for req in requests]
        if len(node.spawns) > budget.spawn_rounds:
            reason = f"at most {budget.spawn_rounds} spawn calls per agent"
            return [(req, None, reason) for req in requests]
        verdicts = []
        admitted = 0
        for n, request in enumerate(requests):
            _, missing = resolve_keys(request.context_keys, run.task.context)
            prompt = None
            if n >= budget.clones_per_spawn:
                reason = f"at most {budget.clones_per_spawn} clones per spawn call"
            elif run.clones + admitted >= budget.clones_per_tree:
                reason = f"at most {budget.clones_per_tree} clones per tree"
            elif missing:
                known = ", ".join(sorted(run.task.context)[:20]) or "none"
                reason = f"unknown context key(s) {', '.join(missing)} (known: {known})"
            else:
                prompt, reason = self._clone_prompt(request, run.task.context)
                if prompt is not None:
                    admitted += 1
            verdicts.append((request, prompt, reason))
        return verdicts

    def _clone_prompt(self, request: SpawnRequest, context) -> tuple[list[int] | None, str | None]:
        """The clone's prompt, or why it gets none: it does not render or does not fit.

        A prompt that fails to render (text the parser let through but the tokenizer or the
        chat template refuses) is refused like any other objective: a dead parent would be
        dropped from training and spare the policy the reward of its malformed call. The
        reason names the exception type only; its message may carry the offending text.
        """
        try:
            prompt = self.protocol.clone_prompt(request, context)
        except Exception as error:
            return None, f"the clone prompt could not be rendered ({type(error).__name__})"
        if len(prompt) >= self.budget.node_context:
            return None, (
                f"clone prompt of {len(prompt)} tokens exceeds the context budget "
                f"of {self.budget.node_context}"
            )
        return prompt, None

    @staticmethod
    def _result_of(child: Node) -> CloneResult:
        if child.finish_reason == "error":
            return CloneResult(error=f"clone failed ({child.error})")
        if not child.answer:
            return CloneResult(error="clone ran out of budget without an answer")
        return CloneResult(answer=child.answer)

    def _inject(self, node: Node, results: list[CloneResult], kind: str) -> None:
        # Keep one token of context free so the parent can always continue after the results.
        room = self.budget.node_context - node.context_length - 1
        # return_tokens caps what a clone says; a notice is the engine's own short text, and
        # cut to a clone's answer it would lose what the model needs to repair its call (the
        # form an empty call is shown), so only the context bounds it.
        per_result = self.budget.return_tokens if kind == "return" else room
        ids = self._render(results, room, per_result)
        if ids is None:
            node.finish_reason = "budget"
            return
        node.segments.append(Segment(kind, ids, None, self.protocol.decode(ids)))

    def _render(self, results: list[CloneResult], room: int, per_result: int) -> list[int] | None:
        """The results' tokens; each result that fails to render alone is replaced by an error
        entry, so the parent still reads the others (a failure of the framing itself, which no
        result causes, still fails the node)."""
        try:
            return self.protocol.render_results(results, room, per_result)
        except Exception:
            results = [self._renderable(result, room, per_result) for result in results]
        return self.protocol.render_results(results, room, per_result)

    def _renderable(self, result: CloneResult, room: int, per_result: int) -> CloneResult:
        """``result``, or an error entry naming the exception type (not its message, which may
        carry the offending text) when it does not render."""
        try:
            self.protocol.render_results([result], room, per_result)
        except Exception as error:
            return CloneResult(error=f"the result could not be rendered ({type(error).__name__})")
        return result


def _run_sync(coroutine):
    """Run a coroutine to completion, also from inside a running event loop (a notebook):
    then on a worker thread with its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
