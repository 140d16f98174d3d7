"""A backend for tests, in one file: the torch backend with every expert op counted.

Registered with one line (`backends.register(CountingBackend)`), it is chosen like any other
(EngineOptions(backend="counting")); the counts prove that every expert computation of the
engine, decode and prefill, goes through the backend's ops.
"""

from __future__ import annotations

import collections

from edge0.engine.backends.torch import TorchBackend, TorchExperts


class CountingExperts(TorchExperts):
    def __init__(self, calls: collections.Counter):
        self.calls = calls

    def token(self, x, experts):
        self.calls["token"] += 1
        self.calls["experts"] += len(experts)
        return super().token(x, experts)

    def rows(self, x, groups):
        self.calls["rows"] += 1
        self.calls["experts"] += len(groups)
        return super().rows(x, groups)

    def dense(self, layout, x, t):
        self.calls["dense"] += 1
        self.calls["experts"] += 1
        return super().dense(layout, x, t)


class CountingBackend(TorchBackend):
    name = "counting"

    def __init__(self, options):
        super().__init__(options)
        self.calls: collections.Counter = collections.Counter()

    def expert_ops(self, arrangement):
        return CountingExperts(self.calls)
