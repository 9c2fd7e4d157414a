"""Triton's compiled kernels in the shared compile cache (remote.py).

Triton looks its cache manager up by name (TRITON_CACHE_MANAGER, which
codegen/triton_load.py's `share_triton_cache` sets when EGC_REMOTE_CACHE is set): this module is
loaded by Triton itself, and is the one place that subclasses Triton's cache.
"""
from __future__ import annotations

import json

from triton.runtime.cache import FileCacheManager

from egraph_compiler import remote


class SharedCacheManager(FileCacheManager):
    """Triton's file cache with the shared compile cache behind it: a file missing
    here is fetched (verified by remote.py) and kept here; a file Triton writes is
    also stored there.  A group (one kernel's binaries and metadata) is shared as
    the list of its files' names, each file under its own key."""

    def _shared_key(self, filename: str) -> str:
        return remote.artifact_key("triton", [self.key, filename], machine=False)

    def get_file(self, filename):
        path = super().get_file(filename)
        if path is None and not filename.startswith("__grp__"):
            data = remote.fetch(self._shared_key(filename))
            if data is not None:
                path = super().put(data, filename)
        return path

    def put(self, data, filename, binary=True):
        path = super().put(data, filename, binary)
        if not filename.startswith("__grp__"):  # a group's local file names local paths
            remote.store(self._shared_key(filename), data if isinstance(data, bytes) else str(data).encode())
        return path

    def get_group(self, filename):
        found = super().get_group(filename)
        if found is not None:
            return found
        names = remote.fetch(self._shared_key("__grp__" + filename))
        if names is None:
            return None
        try:
            children = json.loads(names)
        except ValueError:
            return None
        group = {}
        for child in children:
            path = self.get_file(child)
            if path is None:
                return None
            group[child] = path
        super().put_group(filename, group)
        return group

    def put_group(self, filename, group):
        path = super().put_group(filename, group)
        remote.store(self._shared_key("__grp__" + filename), json.dumps(sorted(group)).encode())
        return path
