"""torch's internals the runtime inside a worker reaches (see the package's doc).

Checked against torch 2.11.0, 2.13.0 and 2.14.1 (their sources read side by
side; tests/test_torch_compat.py resolves every name on each). Main thread
only, like the hooks that call them, except where a function says otherwise.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from . import WRAPPED, patch, patched


def process_groups() -> list[Any]:
    """Every process group this process created, the default one included."""
    import torch.distributed.distributed_c10d as c10d

    return list(c10d._world.pg_map)


def default_group() -> Any:
    from torch.distributed.distributed_c10d import _get_default_group

    return _get_default_group()


def foreach_copy() -> Callable[[list, list], None]:
    """``torch._foreach_copy_(dst, src)``: one fused copy of many tensors (bound
    once by the caller: it runs at every minibatch start)."""
    import torch

    return torch._foreach_copy_


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the backward pass in progress has run its graph (from a
    tensor hook inside it), before DDP's finalize waits for its all-reduces."""
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(fn)


def patch_env_rendezvous(make: Callable[[Callable], Callable]) -> bool:
    """Replace the ``env://`` rendezvous handler with ``make(original)``.
    register_rendezvous_handler refuses to replace a scheme; the table is what it fills."""
    # the module, not the function torch.distributed.rendezvous that shadows it
    rdzv = sys.modules["torch.distributed.rendezvous"]
    table = rdzv._rendezvous_handlers
    orig = table["env"]
    if patched(orig):
        return False
    new = make(orig)
    setattr(new, WRAPPED, orig)
    table["env"] = new
    return True


def patch_ddp_pre_forward(after: Callable[[Any], None]) -> bool:
    """``after(ddp)`` once each ``DistributedDataParallel._pre_forward`` returned:
    its buffer broadcast done, the wrapped module's forward next."""
    import functools

    from torch.nn.parallel import DistributedDataParallel as DDP

    def make(orig):
        @functools.wraps(orig)
        def pre_forward(self, *inputs, **kwargs):
            out = orig(self, *inputs, **kwargs)
            after(self)
            return out

        return pre_forward

    return patch(DDP, "_pre_forward", make)


def detach_ddp(ddp: Any) -> None:
    """Drop a DDP module's reducer and communication hooks (their process group
    is being destroyed); ``attach_ddp`` builds them again."""
    ddp.reducer = None
    ddp.logger = None
    ddp.process_group = None
    ddp._comm_hooks = []


def attach_ddp(ddp: Any) -> None:
    """Rebuild a detached DDP module's reducer on the (new) default group, as its
    constructor does."""
    ddp.process_group = default_group()
    params, sparse = ddp._build_params_for_reducer()
    ddp._ddp_init_helper(params, sparse, ddp._build_debug_param_to_name_mapping(params), ddp.static_graph)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()


def dcp_mem_format_encoding() -> Any:
    """The enum DCP's metadata pickles (the one global its safe unpickler allows by getattr)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    return _MEM_FORMAT_ENCODING


def dcp_fqns(model: Any, name: str) -> Any:
    """The fully qualified names a parameter's state is saved under (DCP's rule)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    return _get_fqns(model, name)
