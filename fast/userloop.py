"""fast/userloop.py: the user simulator's own thread, an event loop where its requests run while the rollout's thread
decodes (batched_rollout.py): a user behind an endpoint never stalls decoding, and its concurrency limit applies
there."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading

from envs.users import close_user_sim

log = logging.getLogger("muarl.rollout")


class UserLoop:
    """An event loop in a thread of its own, where the user simulator's requests run while the caller's thread
    decodes. The model only ever runs in the caller's thread (with its autocast, device and sharding state, which
    are per thread in torch); the user thread touches only the user simulator's state of the episodes it answers."""

    def __init__(self, user_sim):
        self.user_sim = user_sim
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="muarl-users", daemon=True)
        self.thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wait(self, futures, first: bool) -> None:
        """Wait for the first of `futures` (or all), in slices, so that a user thread that died fails loudly
        instead of leaving the rollout waiting forever."""
        how = concurrent.futures.FIRST_COMPLETED if first else concurrent.futures.ALL_COMPLETED
        while True:
            done, pending = concurrent.futures.wait(futures, timeout=5.0, return_when=how)
            if done if first else not pending:
                return
            if not self.thread.is_alive():
                raise RuntimeError("the user simulator's thread stopped with requests still waiting")

    def close(self) -> None:
        """Cancel what still runs (a rollout that raised or was interrupted), release the simulator's client, stop
        the loop and join the thread."""
        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await close_user_sim(self.user_sim)

        try:
            if self.thread.is_alive():
                self.submit(cancel_all()).result(timeout=30)
        except Exception:  # a task that will not cancel, or a client that will not close: the thread is a daemon
            log.warning("the user simulator's thread did not shut down cleanly", exc_info=True)
        finally:  # stop() is safe before run_forever starts and after it ended
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
            if not self.thread.is_alive():
                self.loop.close()
