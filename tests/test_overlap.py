"""``kvbench.overlap.LayerWorker``: layers compressed in order on a thread beside the pass, which it holds back once
``DEPTH`` layers wait, in the pass's autograd modes."""

from __future__ import annotations

import threading

import pytest
import torch

from kvbench.kv import LayerKV
from kvbench.overlap import DEPTH, LayerWorker


def layer(n: int = 3) -> LayerKV:
    return LayerKV(keys=torch.zeros(1, 1, n, 2), values=torch.zeros(1, 1, n, 2),
                   positions=torch.arange(n).view(1, 1, n), lengths=torch.full((1, 1), n))


def test_layers_are_compressed_in_order_in_the_modes_they_were_submitted_in():
    seen = []
    worker = LayerWorker(lambda i, kv, stats: seen.append((i, torch.is_inference_mode_enabled(),
                                                           torch.is_grad_enabled())), torch.device("cpu"))
    with torch.inference_mode():
        worker.submit(0, layer(), [])
    with torch.no_grad():
        worker.submit(1, layer(), [])
    worker.submit(2, layer(), [])
    worker.close()
    assert seen == [(0, True, False), (1, False, False), (2, False, True)]


def test_the_pass_waits_once_depth_layers_wait_for_the_worker():
    release, started = threading.Event(), threading.Event()

    def slow(i, kv, stats):
        started.set()
        release.wait(10)

    worker = LayerWorker(slow, torch.device("cpu"))
    worker.submit(0, layer(), [])  # the worker holds it
    assert started.wait(10)
    for i in range(DEPTH):
        worker.submit(1 + i, layer(), [])  # these wait in the queue
    submitted = threading.Event()
    extra = threading.Thread(target=lambda: (worker.submit(1 + DEPTH, layer(), []), submitted.set()))
    extra.start()
    assert not submitted.wait(0.3)  # one more layer would be one more uncompressed layer held: the pass waits
    release.set()
    extra.join(10)
    assert submitted.is_set()
    worker.close()


def test_a_failed_layer_skips_the_rest_and_close_raises_it():
    seen = []

    def fails_at_1(i, kv, stats):
        if i == 1:
            raise ValueError("layer 1")
        seen.append(i)

    worker = LayerWorker(fails_at_1, torch.device("cpu"))
    for i in range(4):
        worker.submit(i, layer(), [])
    with pytest.raises(ValueError, match="layer 1"):
        worker.close()
    assert seen == [0] and not worker.thread.is_alive()
