"""A staged decode token (the prerouter's) of one request through every layer in one native call.

The exact path's token goes through one call where the pool holds every expert
(native_token.py). A prediction-routed token is staged instead: it touches the pool in the
middle of the token. Its consumers compute with experts whose reads were started one token
ahead and may still be in flight; each owner's head chooses its consumer's experts for the
next token, whose reads must start while the later layers compute; a layer routed by its own
router reads its misses now. Layer by layer, Python does those between the native ops
(executors.py StagedExecutor, prerouter/runtime.py). `TokenDecoder.staged_step`
(decode_ops.cpp) runs the same ops in the same order in one call, without the GIL, and hands
the pool's part to a thread of this class over `edge0.Handoff` (native/handoff.h):

- the pool tells the handoff each slot's state (ExpertPool.watch), so the call waits on a
  slot's read without Python;
- the call posts a head's chosen experts (stage), the experts a layer must read now (need:
  their slots come back), a layer done (release), and the token's end; this thread does what
  the per-layer path does at those points (PrerouterState._stage, ExpertPool.request and
  release), in the same order, and answers each but a release, which the call does not wait
  for.

So the routing, the experts, the staged sets and the bits are the per-layer path's; what goes is
the Python between the layers. The heads run inline in the call, as on a machine whose
intra-op threads take every core (PrerouterRuntime.threaded). It serves one request's step
where the native token op serves its layers (NativeToken.servable) and the prerouter's heads
are the native op's, each owner staging one softmax-routed consumer with W = K; anything else
(a batched step, W > K, heads on their own thread) goes layer by layer.

Shape legend: L decoder layers, C consumers, H heads, K active, E experts, D hidden.
"""

from __future__ import annotations

import threading
import weakref

import torch

from edge0 import native
from edge0.engine.backends.native_token import NativeToken, written
from edge0.models.layers import KVCache
from edge0.prerouter.runtime import PrerouterRuntime, PrerouterState
from edge0.store.pool import Entry

# edge0::Handoff's message kinds (handoff.h)
STAGE, NEED, RELEASE, END, STOP = range(5)


class NativeStaged(NativeToken):
    """A staged decode token of one request in one call (see the module docstring)."""

    def __init__(self, runtime: PrerouterRuntime, model, layers, pool, layout, isa, cache_dir=None):
        super().__init__(model, layers, pool, layout, isa, cache_dir)
        self.rt = runtime
        self.handoff = native.handoff(cache_dir)(pool.num_slots)
        self.pool.watch(self.handoff.set_slot)
        self._slot_views = None
        # what the thread works for during a call: the request's state, the entries it holds
        # by layer (the staged ones taken over, those read now), the first error it met
        self._state: PrerouterState | None = None
        self._held: dict[int, list[Entry]] = {}
        self._error: BaseException | None = None
        # the thread holds the handoff and a weak reference: an engine dropped without close()
        # is still collected, and its collection stops the thread
        self._thread = threading.Thread(
            target=_serve, args=(self.handoff, weakref.ref(self)), name="edge0-stager", daemon=True
        )
        self._thread.start()
        weakref.finalize(self, self.handoff.stop)

    @staticmethod
    def serves(runtime: PrerouterRuntime) -> bool:
        """Whether the call runs this prerouter as the per-layer path does: its heads the
        native op's, inline (no heads thread), each owner staging its one consumer (a softmax
        router's: op_stages) with W = K, every consumer after its owner."""
        rt = runtime
        return (
            rt.native is not None
            and rt.worker is None
            and not rt.wide
            and all(rt.op_stages.get(o) for o in rt.owners)
            and all(c > rt.wiring.owner_of[c] for c in rt.consumers)
            and len({b.top_k for b in rt.blocks.values()}) == 1
        )

    def _pool_key(self) -> int:
        return 0  # the decoder holds the slots' views, which live as long as the pool

    def _views(self) -> list[list]:
        return [[] for _ in self.stand_ins]  # no table of experts: they come from the slots

    def _more(self, decoder) -> None:
        if self._slot_views is None:
            self._slot_views = self.pool.slot_tensors()
        views = self._slot_views
        fields = ([getattr(t, f) for t in views] for f in ("w13", "p13", "w2", "p2"))
        decoder.set_slots(*fields, self.handoff)
        rt = self.rt
        decoder.set_consumers(rt.consumers)
        for o in rt.owners:
            (c,) = rt.consumers_of[o]
            decoder.add_head(o, c, *rt.native.parts[o], rt.native.isa)

    def step(self, cache: KVCache, token: int, state: PrerouterState) -> torch.Tensor | None:
        """The next logits [1, V] after `token`, written into `cache`, the next token's
        predictions made and their reads started (the state flushed, as decode.step does);
        None (nothing done) where the call does not serve this step."""
        rt, top_k = self.rt, self.rt.stage_width
        if len(state.predicted) != len(rt.consumers) or any(
            len(entries) != top_k for entries in state.staged.values()
        ):
            return None  # (its predictions are made at the prompt's end, a full set each)
        decoder = self.decoder([cache])
        if decoder is None:
            return None
        layers = len(self.stand_ins)
        staged = [[-1] * (2 * top_k)] * layers
        for c, entries in state.staged.items():
            staged[c] = [en.key[1] for en in entries] + [en.slot for en in entries]
        none = torch.full((1, top_k), -1, dtype=torch.long)
        previous = torch.cat([state._executed.get(o, none) for o in rt.owners])
        predicted = torch.cat([state.predicted[c] for c in rt.consumers])
        # the staged entries are the call's now: the thread unpins each after its layer
        self._held, state.staged = dict(state.staged), {}
        self._state, self._error = state, None
        inputs = self.inputs(decoder, [cache], [token])
        staged_t = torch.tensor(staged, dtype=torch.long).view(layers, 2, top_k)
        try:
            out = decoder.staged_step(*inputs, predicted, staged_t, previous)
        except RuntimeError:
            self._raise_cause()
            raise
        finally:
            for entries in self._held.values():  # none after a whole token
                self.pool.release(entries)
            self._held, self._state = {}, None
        written([cache], layers)
        if self._error is not None:
            raise self._error
        self._after(state, out)
        return self.logits(out, 6)

    def _after(self, state: PrerouterState, out: list[torch.Tensor]) -> None:
        """The step's results where the per-layer path keeps them: the heads' inputs and
        predictions for the next token (then made current, as decode.step's flush does), the
        counters."""
        rt = self.rt
        routed, logits, chosen, hs, counts = out[1:6]
        blocked, head_ns, dropped = counts.tolist()
        for i, (o, picks) in enumerate(zip(rt.owners, chosen.tolist(), strict=True)):
            (c,) = rt.consumers_of[o]
            state._next_predicted[c] = logits[i : i + 1]
            state._next_chosen[c] = picks
            state._keep(o, hs[i : i + 1], routed[o])  # the owner's features, as observe keeps them
        self.pool.count_blocked(blocked)
        rt.stats.head_ns += head_ns
        rt.stats.dropped += dropped
        rt.stats.consumed += len(rt.consumers) * rt.stage_width
        state.flush()

    def _raise_cause(self) -> None:
        """After a failed call: the error behind it, where the pool's side has it (its own
        error, or a read's, which ExpertPool.wait raises); else nothing (the call's stands)."""
        if self._error is not None:
            raise self._error
        failed = [en for entries in self._held.values() for en in entries if en.failed]
        if failed:
            self.pool.wait(failed)  # raises the read's own error

    def _take(self, kind: int, layer: int, reserve: int, experts: list[int]) -> None:
        """One message of the call (see the module docstring); an error is kept for step()
        and, where the call waits for an answer, refused with."""
        handoff = self.handoff
        try:
            if kind == STAGE:
                state = self._state
                state._stage(layer, experts, state._next_staged, reserve)
                handoff.answer([])
            elif kind == NEED:
                entries = self.pool.request(layer, experts)
                self._held.setdefault(layer, []).extend(entries)
                handoff.answer([en.slot for en in entries])
            elif kind == RELEASE:
                self.pool.release(self._held.pop(layer, []))
            else:
                handoff.answer([])
        except BaseException as e:  # raised to step()'s caller when the call returns
            if self._error is None:
                self._error = e
            if kind != RELEASE:
                handoff.refuse(f"{type(e).__name__}: {e}")

    def close(self) -> None:
        """Ends the thread (the engine's close)."""
        if self._thread.is_alive():
            self.handoff.stop()
            self._thread.join()


def _serve(handoff, staged: weakref.ref) -> None:
    """The pool's thread: each message of the call, in order (see the module docstring), until
    told to stop."""
    while True:
        for message in handoff.next():
            owner = staged()
            if message[0] == STOP or owner is None:
                return
            owner._take(*message[:3], message[3:])
            del owner
