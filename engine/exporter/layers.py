"""A model's programs traced through a few of its layers, the rest copied from those: torch.export's trace grows with
depth (at a Llama 3.2 1B's widths, 0.4 s a layer of a build's 9 s export), a copy of a traced layer's nodes costs
milliseconds.

Layers of one kind (every attribute of the block alike but its place in the cache, `Attention.index`) trace to the
same nodes in the same order; what differs is which parameters they read, the buffer versions and residual stream
they take from the layer before, and the literals that are their index. The trace runs each kind's first two layers
(the model's `layers` swapped for just those); the two are compared node by node to find those literals, and every
other layer is the first's nodes with its own parameters and index. The program that results is the one a trace of
every layer gives, node for node (tests/test_repeated_layers.py compares the MLIR), and anything it cannot match is
refused (NotRepeatable): the caller then traces every layer.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, Iterator

import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, OutputKind, TensorArgument

from .model import StreamingLlama

_LAYER = re.compile(r"^root\.layers\.(\d+)(?:\.|$)")


class NotRepeatable(Exception):
    """The trace of a few layers did not have the shape this module copies from."""


def kind(block: torch.nn.Module) -> Hashable:
    """What makes a layer's program: every plain attribute of the block and its modules but its index in the cache
    (callables by name: a block's activation)."""
    out = []
    for path, module in block.named_modules():
        for key, value in sorted(vars(module).items()):
            if key.startswith("_") or key == "index":
                continue
            if isinstance(value, (bool, int, float, str, tuple, type(None))):
                out.append((path, key, value))
            elif callable(value) and not isinstance(value, torch.nn.Module):
                out.append((path, key, getattr(value, "__qualname__", repr(value))))
    return tuple(out)


def probe(model: StreamingLlama) -> tuple[list[Hashable], tuple[int, ...]]:
    """Each layer's kind, and the layers a trace runs: the first two of each kind."""
    kinds = [kind(block) for block in model.layers]
    seen: dict[Hashable, int] = {}
    traced = []
    for i, k in enumerate(kinds):
        if seen.get(k, 0) < 2:
            seen[k] = seen.get(k, 0) + 1
            traced.append(i)
    return kinds, tuple(traced)


def export_repeated(model: StreamingLlama, trace: Callable[[], ExportedProgram], strict: bool = False) -> ExportedProgram:
    """trace() of the model with its layers repeated from a few traced ones, or of all of them where that would save
    nothing or (unless `strict`: then NotRepeatable is raised) the few do not match."""
    kinds, traced = probe(model)
    if len(traced) == len(kinds):
        return trace()
    # Only the traced layers' parameters are the trace's: lifting and faking every layer's, for each program, was
    # a third of an 8B's trace.
    layers = model.layers
    model.layers = _Some(layers, traced)
    try:
        program = trace()
    finally:
        model.layers = layers
    try:
        return repeat(program, model, kinds, traced)
    except NotRepeatable:
        if strict:
            raise
        return trace()


class _Some(torch.nn.Module):
    """Some of a model's layers under their own numbers (their parameters keep their names), run in that order."""

    def __init__(self, layers: torch.nn.ModuleList, keep: tuple[int, ...]) -> None:
        super().__init__()
        for i in keep:
            self.add_module(str(i), layers[i])

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules.values())


def _layer(node: fx.Node) -> int | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        m = _LAYER.match(path)
        if m:
            return int(m.group(1))
    return None


@dataclass
class _Segment:
    """One traced layer's nodes and what they take from outside."""
    layer: int
    nodes: list[fx.Node]
    x_out: fx.Node | None = None
    versions: dict[str, list[fx.Node]] = field(default_factory=dict)  # buffer -> its versions made here
    literals: list[tuple[int, tuple]] = field(default_factory=list)  # where the index is: (node's place, path)
    compared: bool = False  # with a second layer of its kind


def repeat(program: ExportedProgram, model: StreamingLlama, kinds: list[Hashable],
           traced: tuple[int, ...]) -> ExportedProgram:
    """The program traced through `traced` layers, made into the program of all of them."""
    graph = program.graph
    sig = program.graph_signature
    nodes = list(graph.nodes)

    # The nodes of each traced layer: one run each, in the traced order.
    runs: list[tuple[int | None, list[fx.Node]]] = []
    for node in nodes:
        layer = _layer(node)
        if runs and runs[-1][0] == layer:
            runs[-1][1].append(node)
        else:
            runs.append((layer, [node]))
    if len(runs) == 1:  # no layer ran (reset, snapshot): it reads no layer's parameters either
        return program
    if [r[0] for r in runs] != [None, *traced, None]:
        raise NotRepeatable(f"layers traced as {[r[0] for r in runs]}, expected {list(traced)} between")
    prelude, postlude = runs[0][1], runs[-1][1]
    segments = [_Segment(layer, ns) for layer, ns in runs[1:-1]]
    where: dict[fx.Node, int] = {n: s for s, seg in enumerate(segments) for n in seg.nodes}

    # Each mutated buffer's versions: its placeholder, then each functional write (or view of one) of the last.
    placeholder = {spec.target: spec.arg.name for spec in sig.input_specs if spec.kind == InputKind.BUFFER}
    by_name = {n.name: n for n in nodes}
    version_of: dict[fx.Node, str] = {}
    for spec in sig.output_specs:
        if spec.kind != OutputKind.BUFFER_MUTATION:
            continue
        node, chain = by_name[spec.arg.name], []
        while node.name != placeholder[spec.target]:
            chain.append(node)
            if not node.args or not isinstance(node.args[0], fx.Node):
                raise NotRepeatable(f"cannot follow {spec.target}'s writes back from {node}")
            node = node.args[0]
        chain.append(node)
        for v in chain:
            version_of[v] = spec.target
    for seg in segments:
        for n in seg.nodes:
            if n in version_of:
                seg.versions.setdefault(version_of[n], []).append(n)

    # The residual stream each layer hands the next: the one node of it, not a buffer's, read after it.
    for s, seg in enumerate(segments):
        later = [n for n in seg.nodes if n not in version_of
                 and any(where.get(u, len(segments)) > s for u in n.users)]
        if len(later) != 1:
            raise NotRepeatable(f"layer {seg.layer} hands on {later}, not one stream")
        seg.x_out = later[0]

    param_of = {spec.arg.name: spec.target for spec in sig.input_specs if spec.kind == InputKind.PARAMETER}

    def role(ref: fx.Node, s: int) -> tuple:
        """What an outside node is to segment s: the same node for every layer, a buffer's latest version, the
        stream, or a parameter of the layer's own."""
        if ref in version_of:
            return ("buffer", version_of[ref])
        if ref.op == "placeholder" and ref.name in param_of:
            m = _LAYER.match(param_of[ref.name])
            if m:
                if int(m.group(1)) != segments[s].layer:
                    raise NotRepeatable(f"layer {segments[s].layer} reads {param_of[ref.name]}")
                return ("param", param_of[ref.name][m.end(1):])
        if ref in where:
            if ref is not segments[where[ref]].x_out or where[ref] != s - 1:
                raise NotRepeatable(f"layer {segments[s].layer} reads {ref} of layer {segments[where[ref]].layer}")
            return ("x",)
        return ("same", ref)

    # The first layer's stream: what it reads that no other layer does (the others read the stream before them).
    outside = [[r for n in seg.nodes for r in n.all_input_nodes if r not in where or where[r] != s]
               for s, seg in enumerate(segments)]
    others = {r for s in range(1, len(segments)) for r in outside[s]} | {r for n in postlude for r in n.all_input_nodes}
    first_x = {r for r in outside[0] if r not in others and r not in version_of
               and not (r.op == "placeholder" and r.name in param_of)}
    if len(first_x) != 1:
        raise NotRepeatable(f"the first layer's stream is one of {first_x}")
    x_in = first_x.pop()

    def roles(s: int) -> dict[fx.Node, tuple]:
        return {r: ("x",) if r is x_in and s == 0 else role(r, s) for r in outside[s]}

    # Each kind's template: its first traced layer; its literals that differ in the second are its index.
    template: dict[Hashable, int] = {}
    for s, seg in enumerate(segments):
        k = kinds[seg.layer]
        if k not in template:
            template[k] = s
            continue
        first = segments[template[k]]
        if len(first.nodes) != len(seg.nodes):
            raise NotRepeatable(f"layers {first.layer} and {seg.layer} differ in length")
        a, b = model.layers[first.layer].attention.index, model.layers[seg.layer].attention.index
        ra, rb = roles(template[k]), roles(s)
        place = {n: i for i, n in enumerate(first.nodes)}
        place_b = {n: i for i, n in enumerate(seg.nodes)}

        def same(x: Any, y: Any, path: tuple, i: int) -> None:
            if isinstance(x, fx.Node) and isinstance(y, fx.Node):
                inside = (x in place, y in place_b)
                if inside == (True, True) and place[x] == place_b[y]:
                    return
                if inside == (False, False) and ra[x] == rb[y]:
                    return
                raise NotRepeatable(f"layers {first.layer} and {seg.layer} read differently at {path}")
            if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y) \
                    and type(x) is type(y):
                for j, (u, v) in enumerate(zip(x, y)):
                    same(u, v, (*path, j), i)
                return
            if isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys():
                for key in x:
                    same(x[key], y[key], (*path, key), i)
                return
            if type(x) is type(y) and x == y:
                return
            if type(x) is int and type(y) is int:
                if (x, y) == (a, b):  # layers of one kind differ in nothing else (kind())
                    first.literals.append((i, path))
                    return
            raise NotRepeatable(f"layers {first.layer} and {seg.layer} differ at {path}: {x!r} and {y!r}")

        for i, (x, y) in enumerate(zip(first.nodes, seg.nodes)):
            if x.op != y.op or x.target != y.target:
                raise NotRepeatable(f"layers {first.layer} and {seg.layer} differ at node {i}: {x.format_node()} and "
                                    f"{y.format_node()}")
            same((x.args, x.kwargs), (y.args, y.kwargs), (), i)
        first.compared = True
    for k, s in template.items():
        if kinds.count(k) > 1 and not segments[s].compared:
            raise NotRepeatable(f"layer {segments[s].layer}'s kind has no second layer traced")

    # The new graph: every layer's parameters where a trace of all of them has them (the model's order, the first
    # inputs), the rest of the prelude as it was, every layer from its kind's template, then the rest.
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    specs = list(sig.input_specs)
    leading = [spec.kind == InputKind.PARAMETER for spec in specs]
    if leading != sorted(leading, reverse=True):
        raise NotRepeatable("parameters are not the program's first inputs")
    traced_param = {spec.target: by_name[spec.arg.name] for spec in specs if spec.kind == InputKind.PARAMETER}
    if not set(traced_param) <= {f"root.{name}" for name, _ in model.named_parameters()}:
        raise NotRepeatable("the trace has parameters the model does not")
    first_of = {kinds[seg.layer]: seg.layer for seg in reversed(segments)}
    param_node: dict[str, fx.Node] = {}
    state = dict(program.state_dict)
    new_specs = []
    for name, tensor in model.named_parameters():
        target = f"root.{name}"
        if target in traced_param:
            node = env[traced_param[target]] = new.node_copy(traced_param[target])
        else:
            m = _LAYER.match(target)
            if not m:
                raise NotRepeatable(f"{target} is not the trace's")
            like = traced_param[f"root.layers.{first_of[kinds[int(m.group(1))]]}{target[m.end(1):]}"]
            node = new.placeholder("p_" + target.replace(".", "_"), type_expr=like.type)
            node.meta = copy.copy(like.meta)
            state[target] = tensor
        param_node[target] = node
        new_specs.append(InputSpec(InputKind.PARAMETER, TensorArgument(node.name), target, None))
    for n in prelude:
        if n not in env:
            env[n] = new.node_copy(n, lambda r: env[r])
    for spec in specs:
        if spec.kind != InputKind.PARAMETER:
            arg = spec.arg
            new_specs.append(replace(spec, arg=TensorArgument(env[by_name[arg.name]].name))
                             if isinstance(arg, TensorArgument) else spec)
    current: dict[Any, fx.Node] = {("x",): env[x_in]}
    for n in prelude:
        if n in version_of:
            current[("buffer", version_of[n])] = env[n]
    for target, name in placeholder.items():
        current.setdefault(("buffer", target), env[by_name[name]])
    for layer, k in enumerate(kinds):
        s = template[k]
        seg, r = segments[s], roles(s)
        index = model.layers[layer].attention.index
        local: dict[fx.Node, fx.Node] = {}

        def outer(ref: fx.Node) -> fx.Node:
            if ref in local:
                return local[ref]
            what = r[ref]
            if what[0] == "same":
                return env[ref]
            if what[0] == "param":
                return param_node[f"root.layers.{layer}{what[1]}"]
            return current[what]

        subs: dict[int, list[tuple]] = {}
        for i, path in seg.literals:
            subs.setdefault(i, []).append(path)
        for i, n in enumerate(seg.nodes):
            args, kwargs = n.args, n.kwargs
            for path in subs.get(i, ()):
                args, kwargs = _put((args, kwargs), path, index)
            copied = new.create_node(n.op, n.target, fx.map_arg(args, outer), fx.map_arg(kwargs, outer),
                                     type_expr=n.type)
            copied.meta = copy.copy(n.meta)
            local[n] = copied
        for buffer, versions in seg.versions.items():
            current[("buffer", buffer)] = local[versions[-1]]
        current[("x",)] = local[seg.x_out]

    def after(ref: fx.Node) -> fx.Node:
        if ref in env:
            return env[ref]
        if ref in version_of:
            return current[("buffer", version_of[ref])]
        if ref is segments[-1].x_out:
            return current[("x",)]
        raise NotRepeatable(f"{ref} is read after the layers")

    for n in postlude:
        env[n] = new.node_copy(n, after)
    module = fx.GraphModule(program.graph_module, new)
    outputs = env[postlude[-1]].args[0]
    outputs_specs = [replace(spec, arg=TensorArgument(name=out.name)) if isinstance(spec.arg, TensorArgument)
                     else spec for spec, out in zip(sig.output_specs, outputs)]
    return program._update(module, replace(sig, input_specs=new_specs, output_specs=outputs_specs), state_dict=state)


def _put(tree: Any, path: tuple, value: Any) -> Any:
    """tree with the literal at path replaced (tuples and lists rebuilt, dicts copied)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, dict):
        return {**tree, head: _put(tree[head], rest, value)}
    items = list(tree)
    items[head] = _put(items[head], rest, value)
    return type(tree)(items) if not isinstance(tree, list) else items
