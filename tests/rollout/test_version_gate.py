"""`VersionGate` (components/rollout/gate.py) under hand-written asyncio schedules: requests and weight updates
are coroutines that block on events the test sets one at a time, and every step they take goes into one log, so
each test states the exact order in which requests start, answer and are tagged around a weight update.
The same gate runs against a real vLLM server in tests/vllm/test_vllm_transfer.py."""

import asyncio

import pytest

from components.rollout.gate import VersionGate, WeightsUnknown


class Schedule:
    """A gate, a log, and requests/updates that run until the test releases them."""

    def __init__(self, version: int = 0) -> None:
        self.gate = VersionGate(version)
        self.log: list[str] = []

    async def request(self, name: str, answer: asyncio.Event) -> int:
        self.log.append(f"{name} asks")
        async with self.gate.request() as version:
            self.log.append(f"{name} sent v{version}")
            await answer.wait()  # the server is still generating
        self.log.append(f"{name} answered v{version}")
        return version

    async def update(self, version: int, loaded: asyncio.Event | None = None, error: BaseException | None = None):
        """An update whose load blocks until `loaded` is set, then raises `error` if given."""
        self.log.append(f"update v{version} asks")

        async def load() -> str:
            self.log.append(f"update v{version} loads")
            if loaded is not None:
                await loaded.wait()
            if error is not None:
                self.log.append(f"update v{version} fails")
                raise error
            self.log.append(f"update v{version} loaded")
            return f"answer of v{version}"

        assert await self.gate.update(version, load) == f"answer of v{version}"


async def settle() -> None:
    """Let every runnable task run until it blocks (a few loop turns is plenty for these schedules)."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_an_update_waits_for_the_request_in_flight_and_holds_the_next_one():
    async def main():
        s = Schedule()
        long_answer, next_answer = asyncio.Event(), asyncio.Event()
        long = asyncio.create_task(s.request("long", long_answer))
        await settle()
        update = asyncio.create_task(s.update(1))
        await settle()
        nxt = asyncio.create_task(s.request("next", next_answer))
        await settle()
        # The update has not loaded (the long request is in flight), and the next request is held, not sent.
        assert s.log == ["long asks", "long sent v0", "update v1 asks", "next asks"]
        assert s.gate.in_flight == 1 and s.gate.pending == 1 and s.gate.draining
        long_answer.set()
        await settle()
        assert s.log[4:] == [
            "long answered v0",
            "update v1 loads",
            "update v1 loaded",
            "next sent v1",
        ]
        assert not s.gate.draining
        next_answer.set()
        assert (await long, await nxt) == (0, 1)
        await update
        assert s.gate.version == 1 and s.gate.in_flight == 0 and s.gate.pending == 0

    asyncio.run(main())


def test_requests_in_flight_all_finish_before_the_load_and_are_all_tagged_with_the_old_version():
    async def main():
        s = Schedule()
        answers = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(s.request(f"r{i}", answers[i])) for i in range(3)]
        await settle()
        update = asyncio.create_task(s.update(1))
        await settle()
        for i in (2, 0):  # answered out of order: the load waits for the last one, whichever it is
            answers[i].set()
            await settle()
            assert "update v1 loads" not in s.log
        answers[1].set()
        await settle()
        assert s.log.index("update v1 loads") > s.log.index("r1 answered v0")
        assert [await t for t in tasks] == [0, 0, 0]
        await update

    asyncio.run(main())


def test_back_to_back_updates_run_one_at_a_time_and_a_held_request_goes_out_on_the_last():
    async def main():
        s = Schedule()
        first_loaded, second_loaded, answer = asyncio.Event(), asyncio.Event(), asyncio.Event()
        u1 = asyncio.create_task(s.update(1, first_loaded))
        await settle()
        req = asyncio.create_task(s.request("r", answer))
        u2 = asyncio.create_task(s.update(2, second_loaded))
        await settle()
        # v1 loads; v2 waits for it; the request waits for both (an update is pending all along).
        assert s.log == ["update v1 asks", "update v1 loads", "r asks", "update v2 asks"]
        assert s.gate.pending == 2 and not s.gate.draining  # v2 waits for v1's load, not for requests
        first_loaded.set()
        await settle()
        assert s.log[4:] == ["update v1 loaded", "update v2 loads"]
        second_loaded.set()
        await settle()
        assert s.log[6:] == ["update v2 loaded", "r sent v2"]
        answer.set()
        assert await req == 2
        await asyncio.gather(u1, u2)

    asyncio.run(main())


def test_an_update_that_fails_part_way_refuses_requests_until_an_update_succeeds():
    async def main():
        s = Schedule()
        with pytest.raises(RuntimeError, match="torn"):
            await s.update(1, error=RuntimeError("torn"))
        assert s.gate.version == 0 and s.gate.pending == 0
        with pytest.raises(WeightsUnknown, match=r"loading weights v1 failed part-way: RuntimeError: torn"):
            await s.request("r", asyncio.Event())
        assert s.gate.in_flight == 0
        await s.update(2)
        answer = asyncio.Event()
        answer.set()
        assert await s.request("after", answer) == 2

    asyncio.run(main())


def test_a_refusal_that_left_the_weights_alone_keeps_the_old_version_usable():
    class Refused(ValueError):
        weights_unchanged = True

    async def main():
        s = Schedule()
        with pytest.raises(Refused):
            await s.update(1, error=Refused("group: not held"))
        answer = asyncio.Event()
        answer.set()
        assert await s.request("r", answer) == 0 and s.gate.unknown is None

    asyncio.run(main())


def test_an_update_cancelled_while_it_waits_reopens_the_gate_on_the_old_version():
    async def main():
        s = Schedule()
        long_answer, held_answer = asyncio.Event(), asyncio.Event()
        long = asyncio.create_task(s.request("long", long_answer))
        await settle()
        update = asyncio.create_task(s.update(1))
        await settle()
        held = asyncio.create_task(s.request("held", held_answer))
        await settle()
        update.cancel()  # the trainer gave up before anything was loaded
        await settle()
        assert "held sent v0" in s.log and "update v1 loads" not in s.log
        assert s.gate.unknown is None and s.gate.pending == 0
        long_answer.set()
        held_answer.set()
        assert (await long, await held) == (0, 0)
        assert update.cancelled()

    asyncio.run(main())


def test_a_request_cancelled_in_flight_or_while_held_leaves_the_counts_right():
    async def main():
        s = Schedule()
        stuck = asyncio.create_task(s.request("stuck", asyncio.Event()))
        await settle()
        update = asyncio.create_task(s.update(1, loaded := asyncio.Event()))
        await settle()
        held = asyncio.create_task(s.request("held", asyncio.Event()))
        await settle()
        held.cancel()  # cancelled before it was sent: never counted
        stuck.cancel()  # the caller gave up on its answer: no longer in flight, so the update goes ahead
        await settle()
        assert s.log[-1] == "update v1 loads" and s.gate.in_flight == 0
        loaded.set()
        await update
        assert s.gate.version == 1 and s.gate.pending == 0

    asyncio.run(main())


def test_a_caller_that_gives_up_mid_load_does_not_open_the_gate_before_the_server_answers():
    async def main():
        s = Schedule()
        loaded, answer = asyncio.Event(), asyncio.Event()
        caller = asyncio.create_task(s.update(1, loaded))
        await settle()
        held = asyncio.create_task(s.request("held", answer))
        await settle()
        caller.cancel()  # e.g. the trainer's transfer failed on its side while the server was loading
        await settle()
        assert caller.cancelled()
        # The server is still loading: the held request must not go out on weights of unknown version.
        assert "held sent v0" not in s.log and "held sent v1" not in s.log and s.gate.pending == 1
        loaded.set()
        await settle()
        assert s.log[-2:] == ["update v1 loaded", "held sent v1"] and s.gate.version == 1
        answer.set()
        assert await held == 1

    asyncio.run(main())


def test_a_load_given_up_on_that_the_server_then_refuses_leaves_the_old_version_usable():
    class Refused(RuntimeError):
        weights_unchanged = True  # e.g. the worker's receive broke off: nothing was loaded

    async def main():
        s = Schedule()
        loaded, answer = asyncio.Event(), asyncio.Event()
        caller = asyncio.create_task(s.update(1, loaded, error=Refused("group: the trainer went away")))
        await settle()
        held = asyncio.create_task(s.request("held", answer))
        await settle()
        caller.cancel()
        await settle()
        assert "held sent v0" not in s.log
        loaded.set()
        await settle()
        assert s.log[-2:] == ["update v1 fails", "held sent v0"] and s.gate.unknown is None
        answer.set()
        assert await held == 0

    asyncio.run(main())


def test_a_preempting_update_calls_the_requests_back_and_they_continue_on_the_new_version():
    """The continue mode: a request in flight watches the `preempt` event it took on entering; the update sets it,
    the request leaves with what it has, the load runs without waiting for its answer, and the request's second part
    goes out on v1 with a fresh event that only the next update sets."""

    async def main():
        gate = VersionGate(0, preempts=True)
        log: list[str] = []
        answer = asyncio.Event()

        async def continued() -> list[int]:
            versions = []
            while True:
                async with gate.request() as version:
                    preempt = gate.preempt
                    versions.append(version)
                    log.append(f"part sent v{version}")
                    called, answered = asyncio.ensure_future(preempt.wait()), asyncio.ensure_future(answer.wait())
                    await asyncio.wait({called, answered}, return_when=asyncio.FIRST_COMPLETED)
                    for task in (called, answered):
                        task.cancel()
                    if answer.is_set():
                        log.append(f"answered v{version}")
                        return versions
                    log.append(f"called back on v{version}")

        async def load() -> None:
            log.append("v1 loads")

        request = asyncio.create_task(continued())
        await settle()
        first = gate.preempt
        await gate.update(1, load)  # returns although the request was never answered
        assert first.is_set() and not gate.preempt.is_set()
        await settle()
        answer.set()
        assert await request == [0, 1]
        assert log == ["part sent v0", "called back on v0", "v1 loads", "part sent v1", "answered v1"]
        drain = VersionGate(0)
        async with drain.request():
            pass
        assert not drain.preempts and not drain.preempt.is_set()

    asyncio.run(main())
