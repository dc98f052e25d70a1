"""Sharded model state for ``jitckpt.resumable``: FSDP2 (``fully_shard``, DTensor parameters).

``resume.resumable`` hands the model and its optimizers here when the model's
parameters are DTensors. What changes against the replicated (DDP) path:

* **What a replica is.** Each rank holds only its shard of the parameters and
  optimizer state. Two ranks are replicas of each other when they hold the same
  shard: equal coordinates along every mesh dimension the parameters are
  sharded on. With HSDP (a 2-D mesh ``(replicate, shard)``) the ranks of one
  column (same shard coordinate) are replicas; jitckpt's ``shard=`` name is
  derived from that coordinate (``fsdp-<i>of<n>``), so the layout
  (``ckpt/step-S/shard-fsdp-<i>of<n>/rank-R``), the launcher's job-wide
  decision (a replica of every shard) and the restore (``pick_replica``, any
  rank of the same shard) work unchanged. A killed rank's shard is restored
  from its healthy replica.
  With pure FSDP (no replicated mesh dimension) every rank is its own shard:
  the surviving ranks' JIT save cannot stand in for a killed rank (it is still
  complete when every rank lives: a SIGTERM, a hang). ``resumable`` says so at
  registration, and after a restart with nothing to restore it says why
  (EC snapshots, ``--jit-ec-every``, or a periodic checkpoint are the fallback).
  It never hands one shard's state to another: the names differ.

* **How it is written.** Each rank writes its own shard with
  ``torch.distributed.checkpoint`` (``FileSystemWriter``, ``no_dist=True``: no
  collective, a peer is gone), in the FQN-keyed format of
  ``get_state_dict`` (model: DTensor per FQN; optimizer: ``{"state": {fqn:
  {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``). Tensors go to the
  DCP files; the optimizer's non-tensor values (param_groups, non-tensor state)
  go into resume.py's ``torch.save`` payload, read back with
  ``weights_only=True``. The files sit in the replica directory that
  ``layout.publish`` checksums (sha256 in the manifest) and renames into place
  atomically; a restore only ever sees a directory that verified.

  The JIT save does not call ``get_state_dict``: it runs inside forward or
  backward (or on the signal watcher thread while the main thread is in a
  collective), where FSDP2 has swapped unsharded parameters into the modules
  and ``model.state_dict()`` would reshard them under the running minibatch
  (its pre-hook frees the all-gathered parameters). The sharded parameters
  (the objects the optimizer updates, only written by its step) are taken
  once, at ``resumable()`` time, under the FQNs ``get_model_state_dict`` gives.

* **How it is read.** ``get_model_state_dict``'s DTensors (and, for the
  optimizer, ``empty_like`` of each parameter's DTensor: the same shard) are
  filled with ``torch.distributed.checkpoint.load`` (``no_dist``: the
  replica's own files hold exactly this rank's chunks) and applied with
  ``set_model_state_dict`` / ``set_optimizer_state_dict`` (not
  ``get_optimizer_state_dict`` for the shapes: on a fresh optimizer it runs a
  ``step()``, which jitckpt's step hooks would count as a minibatch). DCP's
  ``FileSystemReader`` unpickles its ``.metadata`` file with ``pickle.load``;
  ``_SafeReader`` reads it with an allow-list unpickler instead (DCP's metadata
  classes, torch.Size / dtype / layout and nothing else), and tensor data is
  loaded by DCP with ``weights_only=True``. No byte (pickled object) items are
  written, and reading one is refused.

* **When the minibatch starts.** FSDP2 has no DDP forward and its collectives
  are ``all_gather_single`` / ``reduce_scatter_single``: a forward pre-hook on
  the root module (ahead of FSDP's own, which starts the all-gather) marks the
  minibatch start as DDP's does, and those two collectives are guarded like
  the others (a failure there leads to the JIT save).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import sys
import warnings
from typing import Any

import torch

DCP_DIR = "dcp"
_FORMAT = 1


# -- detection and the replica structure -------------------------------------


def _dtensor_cls() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def is_sharded(model: Any) -> bool:
    """The model has DTensor parameters (FSDP2 ``fully_shard``, or tensor parallel)."""
    dt = _dtensor_cls()
    if dt is None or model is None or not callable(getattr(model, "named_parameters", None)):
        return False
    return any(isinstance(p, dt) for _, p in model.named_parameters())


def shard_identity(mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
                   placements: list[tuple[str, ...]]) -> tuple[str, int, list[int]]:
    """(shard name, replicas per shard, sharded mesh dims) of a rank.

    ``placements``: for every DTensor parameter, the kind of each mesh dim's
    placement (``"R"`` replicate, ``"S"`` anything else: sharded or partial).
    A mesh dim is a replica dim when every parameter is replicated along it;
    the rank's shard is its coordinate along the other dims. Pure function, so
    the replica rules are tested without a process group."""
    ndim = len(mesh_shape)
    if len(coordinate) != ndim or any(len(p) != ndim for p in placements):
        raise ValueError("mesh shape, coordinate and placements disagree on the mesh's dimensions")
    shard_dims = [d for d in range(ndim) if any(p[d] != "R" for p in placements)]
    replicas = math.prod(mesh_shape[d] for d in range(ndim) if d not in shard_dims)
    if not shard_dims:
        return "fsdp-all", replicas, []
    name = "fsdp-" + "_".join(f"{coordinate[d]}of{mesh_shape[d]}" for d in shard_dims)
    return name, replicas, shard_dims


def no_replica_message(name: str, world: int) -> str:
    return (f"jitckpt.resumable: the model is sharded with no replication (pure FSDP: each of the {world} ranks "
            f"holds its own shard, this rank {name}). A JIT checkpoint restores a failed rank's shard from a "
            "healthy replica, and here there is none: when a rank dies its shard is lost, the survivors' JIT save "
            "is incomplete and is never used in its place. It still covers failures every rank survives (a "
            "SIGTERM, a hung collective). For JIT recovery from a lost rank use HSDP (fully_shard over a 2-D mesh "
            "(replicate, shard), e.g. init_device_mesh('cpu'|'cuda', (2, world // 2))); otherwise the fallback "
            "is an erasure-coded snapshot (jitrun --jit-ec-every N) or your own periodic checkpoint.")


# -- safe DCP metadata reading -------------------------------------------------


_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
}


def _enum_member(obj: Any, name: str) -> Any:
    # pickle spells an enum member as builtins.getattr(EnumClass, "NAME"); only that is allowed
    from ..torch_compat.worker import dcp_mem_format_encoding

    if obj is not dcp_mem_format_encoding() or not isinstance(name, str) or name.startswith("_"):
        raise pickle.UnpicklingError(f"DCP metadata: getattr({obj!r}, {name!r}) is not allowed")
    return getattr(obj, name)


def _layout(name: str) -> Any:
    if not isinstance(name, str) or not name.startswith("torch.") or not isinstance(
            getattr(torch, name[len("torch."):], None), torch.layout):
        raise pickle.UnpicklingError(f"DCP metadata: {name!r} is not a torch layout")
    return getattr(torch, name[len("torch."):])


class _MetaUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name == "getattr":
            return _enum_member
        if module == "torch.serialization" and name == "_get_layout":
            return _layout
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which a checkpoint's metadata "
                                     "never needs; refusing to load it")


def read_metadata_safely(path: str) -> Any:
    with open(path, "rb") as f:
        return _MetaUnpickler(io.BytesIO(f.read())).load()


def _safe_reader(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        """DCP's FileSystemReader, its pickled ``.metadata`` read with an allow-list."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            md = read_metadata_safely(str(self._get_metadata_path(rank)))
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return _SafeReader(path)


def _load_planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class _TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise RuntimeError(f"jitckpt: checkpoint item {read_item.dest_index.fqn!r} is a pickled object; "
                               "jitckpt's sharded checkpoints hold tensors only and never unpickle objects")

    return _TensorsOnly()


# -- the state -----------------------------------------------------------------


class ShardedState:
    """The model and optimizers of one ``resumable`` call, sharded (FSDP2)."""

    def __init__(self, model: Any, optimizers: list[Any], rank: int = 0, world: int = 1) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from ..torch_compat.worker import dcp_fqns

        dt = _dtensor_cls()
        self.model = model
        self.optimizers = optimizers
        self.rank, self.world = rank, world
        dparams = [(n, p) for n, p in model.named_parameters() if isinstance(p, dt)]
        meshes = []
        for _, p in dparams:
            if all(p.device_mesh != m for m in meshes):
                meshes.append(p.device_mesh)
        if len(meshes) != 1:
            raise NotImplementedError(f"jitckpt.resumable: the model's DTensor parameters live on {len(meshes)} "
                                      "device meshes; sharded resume supports one mesh (one fully_shard mesh for "
                                      "the whole model)")
        mesh = meshes[0]
        coord = mesh.get_coordinate()
        if coord is None:
            raise RuntimeError("jitckpt.resumable: this rank is not part of the model's device mesh")
        kinds = [tuple("R" if pl.is_replicate() else "S" for pl in p.placements) for _, p in dparams]
        self.mesh_shape = tuple(mesh.shape)
        self.mesh_dim_names = list(mesh.mesh_dim_names or ())
        self.coordinate = tuple(coord)
        self.shard, self.replicas, self.shard_dims = shard_identity(self.mesh_shape, self.coordinate, kinds)

        # the objects to read at save time, under get_model_state_dict's FQNs; taken now, while every
        # FSDP group is sharded (before the first forward)
        def canonical(items) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for name, t in items:
                fqns = dcp_fqns(model, name)
                if len(fqns) != 1:
                    raise NotImplementedError(f"jitckpt.resumable: parameter {name} maps to {len(fqns)} FQNs")
                out[next(iter(fqns))] = t
            return out

        params = canonical(model.named_parameters())
        buffers = canonical(model.named_buffers())
        keys = list(get_model_state_dict(model).keys())
        self.model_objs: dict[str, Any] = {}
        for k in keys:
            if k in params:
                self.model_objs[k] = params[k]
            elif k in buffers:
                self.model_objs[k] = buffers[k]
            else:
                raise RuntimeError(f"jitckpt.resumable: state-dict key {k!r} of the sharded model is neither a "
                                   "parameter nor a buffer; cannot take it at the JIT save")
        fqn_of = {id(p): k for k, p in params.items()}
        for i, opt in enumerate(optimizers):
            for g in opt.param_groups:
                for p in g["params"]:
                    if id(p) not in fqn_of:
                        raise RuntimeError(f"jitckpt.resumable: optimizer {i} holds a parameter that is not one of "
                                           "the model's (create the optimizer from model.parameters() after "
                                           "fully_shard)")
        self._fqn_of = fqn_of

    # ---- registration-time explanation

    def explain(self) -> str | None:
        """Why JIT recovery from a lost rank cannot work for this job, or None."""
        if self.replicas > 1:
            return None
        if self.world <= 1:
            return None  # one process: nothing is replicated either way, as for the replicated path
        return no_replica_message(self.shard, self.world)

    # ---- save (no collectives; may run on the watcher thread)

    def _optim_state(self, opt: Any) -> dict:
        sd = opt.state_dict()
        order = [p for g in opt.param_groups for p in g["params"]]
        fqn = [self._fqn_of[id(p)] for p in order]
        state = {fqn[i]: dict(v) for i, v in sd["state"].items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn[i] for i in g["params"]]}
                  for g in sd["param_groups"]]
        return {"state": state, "param_groups": groups}

    def save(self, ckpt_dir: str) -> dict:
        """Write this rank's shard into ``ckpt_dir/dcp``; returns the non-tensor part for the payload."""
        import torch.distributed.checkpoint as dcp

        tensors, meta = self.collect()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(os.path.join(ckpt_dir, DCP_DIR), thread_count=1,
                                                                  sync_files=False),
                     no_dist=True)  # layout.publish fsyncs and checksums every file
        return meta

    def collect(self) -> tuple[dict, dict]:
        """(tensors for DCP: ``{"model": {fqn: DTensor}, "optim": {i: {fqn: {key: tensor}}}}``, the rest)."""
        dt = _dtensor_cls()
        tensors: dict[str, Any] = {"model": {k: t.detach() for k, t in self.model_objs.items()}, "optim": {}}
        optims = []
        for i, opt in enumerate(self.optimizers):
            osd = self._optim_state(opt)
            ten = {f: {k: v.detach() for k, v in st.items() if isinstance(v, torch.Tensor)}
                   for f, st in osd["state"].items()}
            other = {f: {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
                     for f, st in osd["state"].items()}
            tensors["optim"][str(i)] = {f: t for f, t in ten.items() if t}
            optims.append({"param_groups": osd["param_groups"], "nontensor": other, "empty": not osd["state"],
                           # key -> saved as a DTensor (this rank's shard) or a plain tensor (e.g. Adam's step)
                           "tensor_keys": {f: {k: isinstance(v, dt) for k, v in t.items()} for f, t in ten.items()}})
        meta = {"format": _FORMAT, "shard": self.shard, "mesh_shape": list(self.mesh_shape),
                "mesh_dim_names": self.mesh_dim_names, "coordinate": list(self.coordinate),
                "replicas": self.replicas, "model_keys": sorted(self.model_objs), "optimizers": optims}
        return tensors, meta

    # ---- load (all ranks restarting together: collectives are fine)

    def load(self, path: str, meta: dict | None) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise RuntimeError(f"jitckpt.resumable: {path} holds no sharded model state this jitckpt reads "
                               "(was it saved by a run whose model was not sharded?)")
        if meta["shard"] != self.shard or tuple(meta["mesh_shape"]) != self.mesh_shape:
            raise RuntimeError(f"jitckpt.resumable: {path} holds shard {meta['shard']} of a mesh "
                               f"{tuple(meta['mesh_shape'])}; this rank holds {self.shard} of {self.mesh_shape}. "
                               "Restart with the same world size and mesh as the run that saved it")
        if len(meta["optimizers"]) != len(self.optimizers):
            raise RuntimeError(f"jitckpt.resumable: {path} has {len(meta['optimizers'])} optimizers' state, this "
                               f"run passes {len(self.optimizers)}")
        reader_path = os.path.join(path, DCP_DIR)
        md = read_metadata_safely(os.path.join(reader_path, ".metadata"))

        msd = get_model_state_dict(self.model)
        if sorted(msd) != meta["model_keys"]:
            raise RuntimeError(f"jitckpt.resumable: {path} holds model keys that differ from this model's "
                               f"(only saved: {sorted(set(meta['model_keys']) - set(msd))[:5]}, only here: "
                               f"{sorted(set(msd) - set(meta['model_keys']))[:5]})")
        target: dict[str, Any] = {"model": msd, "optim": {}}
        for i, om in enumerate(meta["optimizers"]):
            if not om["empty"]:
                target["optim"][str(i)] = self._optim_slots(path, md, i, om)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
            dcp.load(target, storage_reader=_safe_reader(reader_path), planner=_load_planner(), no_dist=True)
        set_model_state_dict(self.model, target["model"])
        for i, (opt, om) in enumerate(zip(self.optimizers, meta["optimizers"], strict=True)):
            if om["empty"]:
                if opt.state:
                    raise RuntimeError("jitckpt.resumable: the checkpoint's optimizer had no state yet, but this "
                                       "run's already has; call resumable() before the first step")
                continue  # saved before the first step: the fresh optimizer is that state
            loaded = target["optim"][str(i)]
            state = {f: {**om["nontensor"].get(f, {}), **loaded.get(f, {})}
                     for f in set(om["tensor_keys"]) | set(om["nontensor"])}
            # set_optimizer_state_dict first "initialises" an optimizer with no state by a step() with
            # zero gradients and lr 0: that step would run jitckpt's (and the user's) optimizer step hooks
            # and count a minibatch. A placeholder entry makes it skip that; load_state_dict replaces it.
            if not opt.state:
                opt.state[opt.param_groups[0]["params"][0]] = {}
            set_optimizer_state_dict(self.model, opt, {"state": state, "param_groups": om["param_groups"]})


    def _optim_slots(self, path: str, md: Any, i: int, om: dict) -> dict[str, dict]:
        """Empty tensors for optimizer ``i``'s saved state, shaped as DCP's metadata says (a DTensor
        parameter's state as its shard), for dcp.load to fill in place."""
        slots: dict[str, dict] = {}
        for f, keys in om["tensor_keys"].items():
            param = self.model_objs[f]
            slots[f] = {}
            for k, is_dtensor in keys.items():
                tmd = md.state_dict_metadata.get(f"optim.{i}.{f}.{k}")
                if tmd is None or not hasattr(tmd, "size"):
                    raise RuntimeError(f"jitckpt.resumable: {path} lacks optimizer tensor {f}.{k}")
                if is_dtensor:
                    if tuple(tmd.size) != tuple(param.shape):
                        raise RuntimeError(f"jitckpt.resumable: optimizer tensor {f}.{k} in {path} has shape "
                                           f"{tuple(tmd.size)}, its parameter {tuple(param.shape)}")
                    slots[f][k] = torch.empty_like(param, dtype=tmd.properties.dtype)  # a DTensor: its shard
                else:
                    slots[f][k] = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)  # e.g. Adam's step
        return {f: s for f, s in slots.items() if s}


# -- runtime hooks ---------------------------------------------------------------


def install_hooks(rt: Any, model: Any) -> None:
    """Minibatch start at the root module's forward (before FSDP's all-gather; FSDP2's
    collectives are guarded in hooks.py). Only where hooks.install attached the runtime
    (under jitrun, or with fault injection)."""
    cfg = rt.cfg
    if not (cfg.managed or cfg.fault_spec):
        return
    model.register_forward_pre_hook(lambda mod, inp: rt.on_forward(), prepend=True)


def setup(model: Any, optimizers: list[Any], shard: str | int | None, rt: Any) -> ShardedState:
    """resume.resumable's dispatch, before ``register``: the sharded state and its shard name."""
    sh = ShardedState(model, optimizers, rt.cfg.rank, rt.cfg.world_size)
    if shard is not None and str(shard) != sh.shard:
        raise TypeError(f"jitckpt.resumable: shard={shard!r}, but for a sharded (FSDP2) model the shard is the "
                        f"rank's coordinate on the device mesh ({sh.shard}); leave shard= out")
    return sh


def after_register(sh: ShardedState, rt: Any, model: Any) -> None:
    install_hooks(rt, model)
    msg = sh.explain()
    if msg is not None:
        warnings.warn(f"[jitckpt] rank {rt.cfg.rank}: {msg}", RuntimeWarning, stacklevel=3)
        rt.report("sharded_no_replica", shard=sh.shard, world_size=sh.world)


def after_restore(sh: ShardedState, rt: Any, path: str | None) -> None:
    """A restarted pure-FSDP job with nothing to restore: say why it starts over."""
    if path is None and rt.cfg.attempt > 0 and sh.explain() is not None:
        print(f"[jitckpt] rank {rt.cfg.rank}: WARNING: restarted with no checkpoint of every shard to restore "
              f"(this rank holds {sh.shard}, which no other rank replicates): the model starts from its initial "
              "state. See the warning at registration.", file=sys.stderr, flush=True)


__all__ = ["ShardedState", "is_sharded", "shard_identity", "install_hooks", "DCP_DIR"]
