"""mmvl.distributed.inflight: a handed tensor is dropped only once the backend's references are gone.

A backend thread's reference is stood in for by an autograd graph (it holds the tensor natively,
as a gloo work does), released by the test or by another thread a moment later."""
import threading
import time

import torch

from mmvl.distributed import inflight


def _held(t: torch.Tensor) -> torch.Tensor:
    return (t * t).sum()  # the graph keeps native references to t


def test_settle_waits_for_the_native_references_to_go():
    t = torch.ones(3, requires_grad=True)
    entries = inflight.before(t)
    holder = [_held(t)]
    inflight.hand(entries)
    assert not inflight.settle(timeout_s=0.05)  # still held: settle does not drop it
    assert any(e[0] is t for e in inflight._handed)

    def release() -> None:
        time.sleep(0.05)
        holder.clear()

    thread = threading.Thread(target=release)
    thread.start()
    assert inflight.settle(timeout_s=5.0)
    thread.join()
    assert not inflight._handed


def test_a_new_hand_over_drops_what_was_released():
    kept = torch.ones(2, requires_grad=True)
    entries = inflight.before(kept)
    graph = _held(kept)  # taken after the collective began: the backend's stand-in
    inflight.hand(entries)
    other = torch.ones(2)
    inflight.hand(inflight.before(other))
    assert [e[0] for e in inflight._handed] == [kept, other]  # kept is still held; other was never
    del graph
    fresh = torch.zeros(2)
    inflight.hand(inflight.before(fresh))
    assert [e[0] for e in inflight._handed] == [fresh]
    assert inflight.settle(timeout_s=1.0) and not inflight._handed


def test_references_held_before_the_collective_do_not_count():
    t = torch.ones(3, requires_grad=True)
    graph = _held(t)  # the caller's own graph, older than the collective
    inflight.hand(inflight.before(t))
    assert inflight.settle(timeout_s=1.0)
    del graph
