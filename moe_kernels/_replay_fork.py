"""A stretch of a recorded call that a replay captured into a CUDA graph runs on a side stream.

A layer's shared expert reads nothing the router makes, so inside a CUDA graph it can run beside the routed experts
(:mod:`moe_kernels.layer_shared`). A layer the package records and replays (:mod:`moe_kernels._replay`) and then
captures (:mod:`moe_kernels._replay_graphs`) ran that call eagerly, in line, so its recording has no streams. The layer
marks the shared expert's steps with :func:`side_stream_stretch`; :func:`with_join` places the join before the first
later step that touches what the stretch made; in the capture, :class:`Fork` forks a side stream after every step
before the stretch, issues the stretch there, and joins. A plain replay, outside a capture, runs every step in order
on one stream. Worked example, no GPU needed (marks, and steps as ``(kind, ..., args, kwargs)`` or
``("launch", ..., pointers)``; slot 5 is what the stretch makes, and the launch after the stretch reads it)::

    >>> op = ("op", torch.ops.aten.empty.memory_format, ([4],), {}, (5,), False)   # (makes slot 5)
    >>> launch = ("launch", None, (1, 1, 1), 0, [None], ((0, 5, 0, None),))
    >>> other = ("launch", None, (1, 1, 1), 0, [None], ((0, 1, 0, None),))
    >>> [e[0] if e[0] != "mark" else e[1] for e in with_join([("mark", "fork"), op, ("mark", "fork_end"), other,
    ...                                                           launch])]
    ['fork', 'op', 'fork_end', 'launch', 'join', 'launch']
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def side_stream_stretch(recording):
    """Marks what runs inside as a stretch of ``recording`` (the call being recorded,
    :func:`moe_kernels._replay.recording_now`) that a replay captured into a CUDA graph may run on a side stream
    (:func:`with_join`). The caller vouches that no later step writes what the stretch reads (a shared expert reads
    the layer's input and its weights). ``recording`` None: nothing."""
    if recording is not None:
        recording.events.append(("mark", "fork"))
    try:
        yield
    finally:
        if recording is not None:
            recording.events.append(("mark", "fork_end"))


def with_join(events: list, outside: frozenset = frozenset()) -> list:
    """``events`` (marks, operations and launches in call order) with ``("mark", "join")`` before the first step
    after a :func:`side_stream_stretch` that touches a slot the stretch made, or writes one it read (at the end if
    none does). Without marks, unchanged; the marks dropped, so that the stretch runs in line, where there is not
    exactly one closed stretch, it makes nothing, one of its operations writes a slot made before it, or one of its
    launches points into a slot made before it other than those in ``outside`` (the call's inputs and constants,
    which a launch of the stretch may read). A launch does not say which pointers it writes or reads: one after the
    stretch is taken to write every slot it points into except those in ``outside``."""
    marks = [i for i, event in enumerate(events) if event[0] == "mark"]
    if not marks:
        return events
    in_line = [event for event in events if event[0] != "mark"]
    if [events[i][1] for i in marks] != ["fork", "fork_end"]:
        return in_line
    begin, end = marks
    made, read = set(), set()
    for event in events[begin + 1:end]:
        if event[0] == "op":
            read.update(slots_in((event[2], event[3])))
            if written(event) - made:
                return in_line
            made.update(o for o in event[4] if o is not None)
        else:
            pointed = {pointer[1] for pointer in event[5]}
            if pointed - made - outside:
                return in_line
            read.update(pointed)
    if not made:
        return in_line
    read -= made
    for i in range(end + 1, len(events)):
        event = events[i]
        if event[0] == "op":
            touched, writes = set(slots_in((event[2], event[3]))), written(event)
        else:   # (a launch into the call's inputs and constants only reads them, as every launch of this package)
            touched = {pointer[1] for pointer in event[5]}
            writes = touched - outside
        if touched & made or writes & read:
            return [*events[:i], ("mark", "join"), *events[i:]]
    return [*events, ("mark", "join")]


def written(event) -> set:
    """The slots a recorded operation writes in place (its schema's written arguments)."""
    _, func, args_t, kwargs_t, _, _ = event
    slots = set()
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            slots.update(slots_in(args_t[position] if position < len(args_t) else kwargs_t.get(argument.name)))
    return slots


class Fork:
    """A replay's side stream while it runs a marked stretch (:func:`side_stream_stretch`): forked after the
    steps before it, left at its end, joined where a later step needs it. :meth:`close` leaves it however the
    replay ended, so that the caller's stream is current again."""

    def __init__(self, side: torch.cuda.Stream):
        self.side, self.main, self.inside = side, None, None

    def step(self, kind: str) -> None:
        if kind == "fork":
            self.main = torch.cuda.current_stream(self.side.device)
            self.side.wait_stream(self.main)
            self.inside = torch.cuda.stream(self.side)
            self.inside.__enter__()
        elif kind == "fork_end":
            self.close()
        else:   # "join"
            self.main.wait_stream(self.side)

    def close(self) -> None:
        if self.inside is not None:
            self.inside.__exit__(None, None, None)
            self.inside = None


class Slot(int):
    """A tensor argument of a recorded operation, by slot."""


def slots_in(value):
    """Every :class:`Slot` in a recorded argument (nested in lists, tuples and dicts)."""
    if isinstance(value, Slot):
        yield value
    elif isinstance(value, (list, tuple, dict)):
        for v in (value.values() if isinstance(value, dict) else value):
            yield from slots_in(v)
