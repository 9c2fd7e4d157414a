"""Bounds checks for Triton's interpreter (TRITON_INTERPRET=1): every load and store a kernel
makes, where its mask lets it through, must fall inside the storage of one of the tensors the
kernel was launched with.  A read past a buffer on the GPU returns whatever lies there, and a
write past one corrupts a neighbour silently; in the interpreter they read and write the
process's heap (a random program aborted with `free(): invalid next size`, TESTING.md).  With
this on, they fail at the access, naming the kernel.  Installed by conftest.py for the suite and
by the soak's Triton workers; a Triton whose interpreter lacks these hooks is left as it is."""
from __future__ import annotations

import numpy as np


class OutOfBounds(RuntimeError):
    pass


def install() -> bool:
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    builder, executor = getattr(interp, "InterpreterBuilder", None), getattr(interp, "GridExecutor", None)
    if (builder is None or executor is None or getattr(builder, "_egc_bounds", False)
            or not all(hasattr(builder, f) for f in ("create_masked_load", "create_masked_store"))
            or not hasattr(executor, "_init_args_hst") or not hasattr(interp, "_get_np_dtype")):
        return bool(getattr(builder, "_egc_bounds", False))
    launch = {"ranges": [], "kernel": "?"}
    init, load, store = executor._init_args_hst, builder.create_masked_load, builder.create_masked_store

    def init_args(self, args_dev, kwargs):
        args, kw = init(self, args_dev, kwargs)
        launch["ranges"] = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                            for t in (*args, *kw.values()) if hasattr(t, "untyped_storage")]
        launch["kernel"] = getattr(self.fn, "__name__", "?")
        return args, kw

    def check(ptrs, mask, what):
        pointers = np.asarray(ptrs.data)
        if mask is not None:
            pointers = pointers[np.broadcast_to(np.asarray(mask.data).astype(bool), pointers.shape)]
        if pointers.size == 0:
            return
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        inside = np.zeros(pointers.shape, bool)
        for start, nbytes in launch["ranges"]:
            inside |= (pointers >= start) & (pointers + size <= start + nbytes)
        if not inside.all():
            far = [int(p) for p in pointers[~inside][:4]]
            raise OutOfBounds(f"{launch['kernel']}: a {what} outside every tensor it was launched with "
                              f"(addresses {far}; tensors at {launch['ranges']})")

    def masked_load(self, ptrs, mask, other, *rest):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, other, *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *rest)

    executor._init_args_hst = init_args
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder._egc_bounds = True
    return True
