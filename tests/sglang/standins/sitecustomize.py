"""The migration guide's `get_kv_class` patch, applied to SGLang in every process of a test server.

tests/sglang/_servers.py puts this folder first on the servers' PYTHONPATH,
so Python imports this module at start-up in the launcher and in every
process SGLang spawns (schedulers, detokenizer). It changes no file of the
installed SGLang: when `sglang.srt.disaggregation.utils` is imported, its
source is read and compiled with the two edits of
docs/guides/migrating-from-sglang.md ("Step 1: swap the classes"): in
`get_kv_class`, the Mooncake branch imports its four classes from
`kvfsm.compat.sglang` instead of `sglang.srt.disaggregation.mooncake`,
and the fake branch its three from `kvfsm.compat.sglang` instead of
`sglang.srt.disaggregation.fake`. Each edit must match exactly once: if
SGLang's source changed, the import fails, naming the line it looked for.

`KVFSM_TEST_GET_KV_CLASS=sglang` leaves SGLang as installed (the servers run
SGLang's own classes), for comparisons.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

TARGET = "sglang.srt.disaggregation.utils"
#: (SGLang's line, the guide's line): the imports of get_kv_class's Mooncake and fake branches.
EDITS = (
    ("        from sglang.srt.disaggregation.mooncake import (\n", "        from kvfsm.compat.sglang import (\n"),
    ("        from sglang.srt.disaggregation.fake import (\n", "        from kvfsm.compat.sglang import (\n"),
)


def patched(source: str) -> str:
    """SGLang's utils.py with the guide's edits; ImportError if one does not match exactly once."""
    for old, new in EDITS:
        count = source.count(old)
        if count != 1:
            raise ImportError(f"kvfsm test patch: expected {old.strip()!r} once in {TARGET}; found it {count} times")
        source = source.replace(old, new)
    return source


class _PatchedLoader(importlib.machinery.SourceFileLoader):
    def source_to_code(self, data: Any, path: Any, *, _optimize: int = -1) -> Any:  # type: ignore[override]
        text = data.decode() if isinstance(data, bytes) else str(data)
        return compile(patched(text), path, "exec", dont_inherit=True, optimize=_optimize)

    def get_code(self, fullname: str) -> Any:
        # Never the cached bytecode of the unpatched file.
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None:
            return None
        loader = _PatchedLoader(fullname, spec.origin)
        return importlib.util.spec_from_file_location(fullname, spec.origin, loader=loader)


if os.environ.get("KVFSM_TEST_GET_KV_CLASS", "kvfsm") == "kvfsm":
    sys.meta_path.insert(0, _Finder())
