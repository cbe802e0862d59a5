"""One table mechanism: rows of `(input, sources) -> dest`, and the step over them.

Every state machine kvfsm declares is a `Table` of `Row`s over an enum of
states, and is stepped the same way: look the `(state, input)` pair up,
and the row found (or none: the input is not allowed there) says where the
record goes and what it sends. The tables that use it:

* a lifecycle's transitions (`Lifecycle.table`, built from its event
  specs; `_lifecycle.py`), which the `transitions` machine and both engines
  are then built from;
* the release phase of a room's pages (`RELEASE_TABLE`, `_release.py`);
* the SGLang request's view of its room (`compat/sglang/_endpoint.py`);
* the wire protocol's per-room records (`backends/wire.py`: `WireRow` and
  `WireTable` are these two classes under the wire's names).

Conventions shared by all of them: a source of `None` is a record that
does not exist yet; a `dest` of `None` drops the record (the wire's
`close`). A row whose `dest` is its own source changes nothing but is
allowed (a lifecycle's internal, progress-only event; a wire chunk).
`sends` names what the step emits, in order (wire messages; empty
elsewhere).

Sans-IO and free of kvfsm's other modules: plain data and one lookup.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs

__all__ = ["Row", "Table"]


@attrs.frozen(slots=True)
class Row:
    """`input` moves a record from any of `sources` to `dest`, sending `sends` (in that order).

    A source of None is a record that does not exist yet; a `dest` of None
    drops the record.
    """

    input: str
    sources: tuple[enum.Enum | None, ...]
    dest: enum.Enum | None
    sends: tuple[str, ...] = ()
    doc: str = ""


@attrs.frozen(slots=True)
class Table:
    """One kind of record: its states, its rows, and the step function over them."""

    name: str
    states: type[enum.Enum]
    rows: tuple[Row, ...]
    doc: str = ""
    index: Mapping[tuple[enum.Enum | None, str], Row] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        index: dict[tuple[enum.Enum | None, str], Row] = {}
        for row in self.rows:
            for source in row.sources:
                if source is not None and not isinstance(source, self.states):
                    raise ValueError(
                        f"{self.name}: row {row.input!r} names source {source!r}, not a {self.states.__name__}"
                    )
                key = (source, row.input)
                if key in index:
                    raise ValueError(f"{self.name}: two rows for {row.input!r} in {source}")
                index[key] = row
            if row.dest is not None and not isinstance(row.dest, self.states):
                raise ValueError(f"{self.name}: row {row.input!r} goes to {row.dest!r}, not a {self.states.__name__}")
        object.__setattr__(self, "index", index)

    def row(self, state: enum.Enum | None, input: str) -> Row | None:
        """The row `input` takes in `state` (None: a new record), or None when not allowed there."""
        return self.index.get((state, input))

    def step(self, state: enum.Enum | None, input: str) -> tuple[bool, enum.Enum | None]:
        """Where `input` takes a record in `state`: (allowed, next state).

        Not allowed leaves the state as it was: `(False, state)`. The one
        step function every table of kvfsm is driven by (callers that also
        need `sends` use `row`).
        """
        row = self.index.get((state, input))
        if row is None:
            return False, state
        return True, row.dest

    def inputs(self) -> tuple[str, ...]:
        """Every input the table knows, in declaration order."""
        return tuple(dict.fromkeys(row.input for row in self.rows))

    def allowed(self, state: enum.Enum | None) -> tuple[str, ...]:
        """The inputs allowed in `state`, in declaration order."""
        return tuple(name for name in self.inputs() if (state, name) in self.index)
