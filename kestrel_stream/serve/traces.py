"""Traces clients ask the daemon for: files only in the --trace-dir, one at a time, each its client's own.

The recorder (obs/trace.py) is one per process, so one trace records at a
time: a second client's ``trace_start`` is refused, never the first one's
trace ended; ``trace_stop`` stops only the caller's own; a client that leaves
has its trace stopped and written.  Names are plain file names (or a path
whose directory is the trace dir) ending .json or .json.gz; an existing file
is never replaced.  Past --trace-max-events the trace records no more (the
file says how many events it dropped).  Start and stop run on the step
thread, where the engine's hooks read the recorder.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from kestrel_stream.errors import CapacityError
from kestrel_stream.wire.protocol import ProtocolError, UnavailableError, runtime_dir

TRACE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SUFFIXES = (".json", ".json.gz")
DEFAULT_DIR_NAME = "kestrel-traces"


class CappedEvents(list):
    """The recorder's event list, which keeps the first ``max_events`` and counts the rest."""

    def __init__(self, events, max_events: int):
        super().__init__(events)
        self.max_events, self.dropped = max_events, 0

    def append(self, event) -> None:
        if len(self) < self.max_events:
            list.append(self, event)
        else:
            self.dropped += 1


def prepare_trace_dir(path: str | None, xdg_runtime_dir: Path | None) -> Path:
    """--trace-dir, made 0700 if missing; by default a private dir beside the daemon's socket."""
    directory = Path(path) if path else runtime_dir(xdg_runtime_dir) / DEFAULT_DIR_NAME
    directory.mkdir(mode=0o700, parents=bool(path), exist_ok=True)
    info = os.lstat(directory)
    if not os.path.isdir(directory) or info.st_uid != os.getuid():
        raise PermissionError(f"--trace-dir {directory}: must be a directory owned by uid {os.getuid()}")
    if not path and info.st_mode & 0o077:
        raise PermissionError(f"{directory} must have mode 0700 (it is {info.st_mode & 0o777:o})")
    return directory


class DaemonTraces:
    def __init__(self, directory: Path, max_events: int):
        self.directory, self.max_events = directory, max_events
        self.owner = None               # the Connection whose trace is recording

    def path_for(self, name) -> Path:
        where = f"trace_start: 'path' {name!r}"
        if not isinstance(name, str) or not name:
            raise ProtocolError("trace_start: field 'path' must be a non-empty string")
        if "/" in name:                 # allowed only as a path straight inside the trace dir
            given = Path(name)
            if not given.is_absolute() or given.parent.resolve() != self.directory.resolve():
                raise ProtocolError(f"{where}: traces are written only in the daemon's trace dir "
                                    f"{self.directory} (serve --trace-dir); send a file name")
            name = given.name
        if not TRACE_NAME.fullmatch(name) or ".." in name or not name.endswith(SUFFIXES):
            raise ProtocolError(f"{where}: a trace name is 1..128 letters, digits, '.', '_' or '-', "
                                f"with no '..', ending {' or '.join(SUFFIXES)}")
        return self.directory / name

    def start(self, conn, name, trace) -> Path:
        """Step thread."""
        if trace.active is not None:
            if self.owner is conn:
                raise CapacityError(f"trace_start: this client's trace {trace.active.path.name} is recording; "
                                    f"trace_stop it first")
            if self.owner is None:
                raise UnavailableError("trace_start: the daemon's own trace (serve --trace) is recording")
            raise CapacityError("trace_start: another client's trace is recording (one at a time); try later")
        path = self.path_for(name)
        try:        # the name is taken now, so that nothing can appear there before the trace is written
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        except FileExistsError:
            raise ProtocolError(f"trace_start: {path.name} already exists in {self.directory}; traces are "
                                f"never replaced, choose another name") from None
        recorder = trace.start(path, command="serve", client=conn.peer)
        recorder.events = CappedEvents(recorder.events, self.max_events)
        self.owner = conn
        return path

    def stop(self, conn, trace) -> Path | None:
        """Step thread: write this client's trace; None if no trace records."""
        if trace.active is None:
            return None
        if self.owner is not conn:
            raise UnavailableError("trace_stop: the trace recording is not this client's")
        events = trace.active.events
        if isinstance(events, CappedEvents) and events.dropped:
            trace.active.metadata["dropped_events"] = events.dropped
            trace.active.metadata["max_events"] = events.max_events
        self.owner = None
        return trace.stop()


def tracer():
    """The process's trace recorder (obs/trace.py), or None in a build without it."""
    try:
        from kestrel_stream.obs import trace
    except ImportError:
        return None
    return trace


def recorder_for(traces: DaemonTraces | None):
    """The recorder for a client's trace_start / trace_stop; UnavailableError in a build without it."""
    trace = tracer()
    if trace is None or traces is None:
        raise UnavailableError("tracing unavailable: this build has no kestrel_stream.obs.trace recorder")
    return trace
