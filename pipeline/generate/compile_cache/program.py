"""A compiled program described (``describe``) and rebuilt around its executable's bytes
(``Program``), from this run's lowering or from the checked description alone."""
from __future__ import annotations

import json

from pipeline.generate.compile_cache.codec import (Refused, aval_from, aval_json, debug_from, debug_json, ints_from,
                                                   sharding_from, sharding_json, tree_from, tree_json)

def _describe(compiled) -> dict:
    """The JSON description from which ``Program`` rebuilds ``compiled`` around its
    executable's bytes, without its lowering; Refused for a program it cannot describe
    in full (effects, host callbacks, constants, custom layouts, other shardings, trees
    of unknown classes), which the index then leaves out."""
    import jax
    from jax._src import stages
    from jax._src.interpreters import pxla

    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if type(unloaded) is not pxla.UnloadedMeshExecutable:
        raise Refused(f"executable {type(unloaded).__name__}")
    u, params = unloaded, compiled._params
    if (u.ordered_effects or u.unordered_effects or u.host_callbacks or u.keepalive or u.mut is not None
            or u.pgle_profiler is not None or params.const_args or params.is_high):
        raise Refused("effects, callbacks, constants or high-level types")
    # layouts: the executable's defaults, recomputed from its bytes as pxla does
    in_layouts, out_layouts = pxla._get_layouts_from_executable(
        u.xla_executable, (None,) * len(u.input_avals), (None,) * len(u.output_avals), 0, u.input_avals,
        u.output_avals)
    if list(in_layouts) != list(u.xla_in_layouts) or list(out_layouts) != list(u.xla_out_layouts) or \
            any(layout is not None for layout in u.dispatch_in_layouts):
        raise Refused("custom layouts")
    args, in_tree = jax.tree_util.tree_flatten(compiled.args_info)
    if not all(type(arg) is stages.ArgInfo for arg in args):
        raise Refused("argument info")
    # jit keeps the argument and result types it traced (pmap does not): they are these
    typed = params.in_types is not None
    if (params.out_types is not None) != typed or typed and (
            params.in_types != (in_tree, [arg._aval for arg in args])
            or params.out_types != (compiled.out_tree, list(u.output_avals))):
        raise Refused("argument or result types of their own")
    all_args = u.all_args_info
    return {"name": u.name, "devices": [int(d.id) for d in u.device_list], "committed": bool(u.committed),
            "kept_var_idx": sorted(int(i) for i in u.kept_var_idx),
            "in_avals": [aval_json(a) for a in u.input_avals], "out_avals": [aval_json(a) for a in u.output_avals],
            "in_shardings": [sharding_json(s) for s in u.input_shardings],
            "out_shardings": [sharding_json(s) for s in u.output_shardings],
            "args": [{"aval": aval_json(arg._aval), "donated": bool(arg.donated)} for arg in args],
            "in_tree": tree_json(in_tree), "out_tree": tree_json(compiled.out_tree),
            "no_kwargs": bool(compiled._no_kwargs), "typed": typed,
            "all_args": None if all_args is None else {"in_avals": [aval_json(a) for a in all_args.in_avals],
                                                       "debug": debug_json(all_args.debug_info)}}


class Program:
    """A description (``_describe``) read back: the program's parts, on ``by_id``'s devices."""

    def __init__(self, obj: dict, by_id: dict):
        from jax._src import stages
        from jax._src.interpreters import pxla

        if not isinstance(obj, dict):
            raise Refused("no description of the program")
        ids = ints_from(obj["devices"])
        if not ids or any(i not in by_id for i in ids):
            raise Refused(f"devices {ids} are not all among this host's {sorted(by_id)}")
        if not isinstance(obj["name"], str) or \
                not all(type(obj[k]) is bool for k in ("committed", "no_kwargs", "typed")):
            raise Refused("name or flags")
        self.name, self.committed, self.no_kwargs = obj["name"], obj["committed"], obj["no_kwargs"]
        self.typed = obj["typed"]
        self.devices = [by_id[i] for i in ids]
        self.kept_var_idx = set(ints_from(obj["kept_var_idx"]))
        self.in_avals = [aval_from(a) for a in obj["in_avals"]]
        self.out_avals = [aval_from(a) for a in obj["out_avals"]]
        self.in_shardings = [sharding_from(s, by_id) for s in obj["in_shardings"]]
        self.out_shardings = [sharding_from(s, by_id) for s in obj["out_shardings"]]
        if len(self.in_shardings) != len(self.in_avals) or len(self.out_shardings) != len(self.out_avals):
            raise Refused("as many shardings as types")
        for arg in obj["args"]:
            if type(arg["donated"]) is not bool:
                raise Refused("argument info")
        self.args = [stages.ArgInfo(aval_from(arg["aval"]), arg["donated"]) for arg in obj["args"]]
        self.in_tree, self.out_tree = tree_from(obj["in_tree"]), tree_from(obj["out_tree"])
        if self.in_tree.num_leaves != len(self.args) or self.out_tree.num_leaves != len(self.out_avals) or \
                not self.kept_var_idx <= set(range(len(self.args))) or len(self.kept_var_idx) != len(self.in_avals):
            raise Refused("trees, arguments and types disagree")
        everything = obj["all_args"]
        self.all_args = None if everything is None else pxla.AllArgsInfo(
            [aval_from(a) for a in everything["in_avals"]], debug_from(everything["debug"]))

    def compiled(self, xla_executable):
        """The ``jax.stages.Compiled`` of ``xla_executable`` (loaded onto ``devices``)."""
        from jax._src import stages

        executable = _mesh_executable(xla_executable, self.name, self.devices, {
            "in_avals": self.in_avals, "out_avals": self.out_avals, "in_shardings": self.in_shardings,
            "out_shardings": self.out_shardings, "in_layouts": (None,) * len(self.in_avals),
            "out_layouts": (None,) * len(self.out_avals), "committed": self.committed,
            "kept_var_idx": self.kept_var_idx, "keepalive": [], "all_args_info": self.all_args})
        in_types, out_types = self.types()
        return stages.Compiled(executable, [], self.in_tree.unflatten(self.args), self.out_tree,
                               no_kwargs=self.no_kwargs, in_types=in_types, out_types=out_types)

    def types(self) -> tuple:
        """(in_types, out_types) as jit keeps them (``_describe``), or (None, None)."""
        if not self.typed:
            return None, None
        return (self.in_tree, [arg._aval for arg in self.args]), (self.out_tree, list(self.out_avals))


def _mesh_executable(xla_executable, name, devices, program: dict):
    """pxla's ``UnloadedMeshExecutable.from_hlo`` from its compilation on: the executable's
    shardings checked against the program's, its layouts read, the result loaded. For
    programs without effects, host callbacks or mutable arrays. ``program``: what the
    program is, named as a lowering's compile arguments name it (``in_avals``,
    ``out_avals``, ``in_shardings``, ``out_shardings``, ``in_layouts``, ``out_layouts``,
    ``committed``, ``kept_var_idx``, ``keepalive``, ``all_args_info``, and optionally
    ``intermediate_shardings`` and ``context_mesh``)."""
    from jax._src.interpreters import pxla
    from jax._src.lib import xla_client as xc

    in_avals, out_avals = program["in_avals"], program["out_avals"]
    in_shardings, out_shardings = program["in_shardings"], program["out_shardings"]
    in_layouts, out_layouts = program["in_layouts"], program["out_layouts"]
    device_list = devices if isinstance(devices, xc.DeviceList) else xc.DeviceList(tuple(devices))
    in_shardings = tuple(pxla.maybe_concretize_mesh(s, device_list) for s in in_shardings)
    out_shardings = tuple(pxla.maybe_concretize_mesh(s, device_list) for s in out_shardings)
    in_shardings = pxla._maybe_get_and_check_in_shardings(xla_executable, in_shardings, device_list, in_avals, 0)
    out_shardings = pxla._maybe_get_and_check_out_shardings(xla_executable, out_shardings, device_list, out_avals, 0)
    xla_in_layouts, xla_out_layouts = pxla._get_layouts_from_executable(xla_executable, in_layouts, out_layouts, 0,
                                                                        in_avals, out_avals)
    dispatch_in_layouts = pxla.get_dispatch_layouts(xla_in_layouts, in_shardings, in_avals)
    out_shardings = pxla.maybe_recover_user_shardings(in_shardings, out_shardings, in_avals, out_avals,
                                                      program.get("intermediate_shardings"),
                                                      program.get("context_mesh"))
    return pxla.UnloadedMeshExecutable(
        xla_executable=xla_executable, device_list=device_list, backend=xla_executable.client,
        input_avals=in_avals, input_shardings=pxla.finalize_shardings(in_shardings, device_list),
        output_avals=out_avals, output_shardings=pxla.finalize_shardings(out_shardings, device_list),
        committed=program["committed"], name=name, unordered_effects=[], ordered_effects=[],
        keepalive=program["keepalive"], host_callbacks=[], kept_var_idx=program["kept_var_idx"], mut=None,
        xla_in_layouts=xla_in_layouts, dispatch_in_layouts=dispatch_in_layouts, xla_out_layouts=xla_out_layouts,
        all_args_info=program["all_args_info"],
        pgle_profiler=None).load()


def lowering_of(lowered):
    """``lowered``'s MeshComputation, if its compiled program can be rebuilt around a
    loaded executable here (``from_lowering``); else Refused."""
    from jax._src.interpreters import pxla

    lowering = getattr(lowered, "_lowering", None)
    if type(lowering) is not pxla.MeshComputation or lowering._device_list is None:
        raise Refused(f"lowering {type(lowering).__name__}")
    args = lowering.compile_args
    poly = args.get("shape_poly_state")
    types = [*(lowered._in_types or ((), []))[1], *(lowered._out_types or ((), []))[1]]
    if (args.get("ordered_effects") or args.get("unordered_effects") or args.get("host_callbacks")
            or args.get("mut") is not None or args.get("pgle_profiler") is not None or lowering.const_args
            or (poly is not None and poly.uses_dim_vars) or any(a.is_high for a in types)):
        raise Refused("effects, callbacks, constants, shape polymorphism or high-level types")
    return lowering


def from_lowering(lowered, xla_executable):
    """The ``jax.stages.Compiled`` that ``lowered.compile()`` makes, with
    ``xla_executable`` in place of XLA's compilation (``MeshComputation.compile``)."""
    from jax._src import stages

    lowering = lowering_of(lowered)
    args = lowering.compile_args
    executable = _mesh_executable(xla_executable, lowering._name, lowering._device_list, {
        **{name: args[name] for name in ("in_shardings", "out_shardings", "in_layouts", "out_layouts", "committed",
                                         "kept_var_idx", "keepalive", "all_args_info")},
        "in_avals": args["global_in_avals"], "out_avals": args["global_out_avals"],
        "intermediate_shardings": args.get("intermediate_shardings"), "context_mesh": args.get("context_mesh")})
    return stages.Compiled(executable, lowering.const_args, lowered.args_info, lowered.out_tree, lowered._no_kwargs,
                           lowered._in_types, lowered._out_types)


def checked_description(compiled, devices) -> dict | None:
    """``_describe(compiled)``, if ``Program`` reads it back to the same parts on
    ``devices`` (as JSON, through a round trip); None if it cannot describe it."""
    import jax

    try:
        description = json.loads(json.dumps(_describe(compiled)))
        program = Program(description, {d.id: d for d in devices})
    except Exception:  # noqa: BLE001 - Refused, or a program of a shape this module does not know
        return None
    u = compiled._executable._unloaded_executable
    args, in_tree = jax.tree_util.tree_flatten(compiled.args_info)
    same = (program.in_avals == list(u.input_avals) and program.out_avals == list(u.output_avals)
            and program.in_shardings == list(u.input_shardings) and program.out_shardings == list(u.output_shardings)
            and program.in_tree == in_tree and program.out_tree == compiled.out_tree
            and [(a._aval, a.donated) for a in program.args] == [(a._aval, a.donated) for a in args]
            and program.devices == list(u.device_list) and program.all_args == u.all_args_info
            and program.types() == (compiled._params.in_types, compiled._params.out_types))
    return description if same else None
