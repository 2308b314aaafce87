"""ELK plans as per-core programs (ELK §4.5 on the Cyclotron-style ISA of :mod:`lowering.isa`).

Every core's program is the chip-wide ELK program restricted to that core:

* ``preload_async(op=j)``: the core allocates the buffers of its share of ``j``'s preloaded data
  (the preload-state plan) and issues the HBM loads; a load's completion is the
  ``done_preload_op_j`` tag: the first instruction that reads the buffer waits for it.
* ``execute(op=i)``: the core waits for the one-way synchronisation token ``go_i`` (every core
  that wrote ``i-1``'s output has reported to the controller core), then runs its tile of
  ``i``'s execute-state plan: input activations gathered from the cores that produced them
(:mod:`lowering.elk_flow`; HBM only for the layer's inputs) and multicast along grid rows, the local
  kernel on the preloaded data, partial results combined between cores, outputs stored, and a
  ``done`` token to the controller.

Rules of ELK §4.5: (1) an ``execute`` blocks every later ``preload_async`` and ``execute`` of the
same core until it finishes, and the next ``execute`` starts only when the controller has seen
every part of this one; (2) a core issues its preloads in the plan's preload order; (3) a
preload blocks only the ``execute`` reading its buffers.  The preloads issued between
``execute(i-1)`` and ``execute(i)`` are those at positions ``issued[i-1] .. issued[i]-1`` of the
preload order.

The controller is the chip's last core; the cores of every tile come from
:mod:`lowering.elk_placement`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import lowering.elk_kernels  # noqa: F401  (registers the kernels)
from elk.cost import Plan, chunks
from elk.ops import Operator
from hwmodel.chip import Chip
from lowering.builder import CoreBuilder, ProgramBuilder, RecordingBuilder
from lowering.elk_flow import Flow
from lowering.elk_layers import Layering, _maker, find_layering
from lowering.elk_pieces import piece_order, rotates
from lowering.elk_placement import Placed, place
from lowering.elk_reduce import scatter
from lowering.errors import ProgramError
from lowering.isa import Load, ProgramSet, Region

__all__ = ["elk_programs"]


def _pre_bufs(
    j: int, pl: Placed, r: int, c: int, order: Sequence[int] | None = None
) -> list[tuple[str, str, tuple, tuple]]:
    """(buffer, tensor, starts, extents) of core ``(r, c)``'s share of ``j``'s preload, piece by
    piece in ``order`` (default: in turn; :func:`lowering.elk_pieces.piece_order`)."""
    op, plan = pl.op, pl.plan
    if op.kind == "matmul":
        _, k, n = op.dims
        kb, nb = k // pl.rows, n // pl.cols
        nc = chunks(kb)
        rb = kb // nc
        # weights are stored tile-major (see :func:`tile_major`): one contiguous block per core
        base = (r * pl.cols + c) * kb
        qs = range(nc) if order is None else order
        return [(f"o{j}_w{q}", op.tensor("w"), (base + q * rb, 0), (rb, nb)) for q in qs]
    if op.kind == "attention":
        b, _, hkv, d, length = op.dims
        tb, tg, ts = plan.tiles
        ib, ig = divmod(r, tg)
        bb, hb, lb = b // tb, hkv // tg, length // ts
        nc = chunks(lb)
        sb = lb // nc
        out = []
        for q in range(nc) if order is None else order:
            st = (ib * bb, ig * hb, c * lb + q * sb, 0)
            ex = (bb, hb, sb, d)
            out += [
                (f"o{j}_k{q}", op.tensor("kc"), st, ex),
                (f"o{j}_v{q}", op.tensor("vc"), st, ex),
            ]
        return out
    return []


def _preload(
    p: CoreBuilder,
    j: int,
    pl: Placed,
    r: int,
    c: int,
    dtype: str,
    order: Sequence[int] | None = None,
) -> None:
    for buf, tensor, st, ex in _pre_bufs(j, pl, r, c, order):
        p.alloc(buf, ex, dtype)
        p.emit(_LOAD(buf, tensor, _REGION(st, ex), True))  # p.load(.., region(st, ex), True)


#: the preloads' Load and Region constructors, one slot store per field (a chip's cores issue
#: hundreds of thousands of preload pieces per layer)
_LOAD, _REGION = _maker(Load), _maker(Region)


def _matmul(
    b: ProgramBuilder,
    p: CoreBuilder,
    j: int,
    pl: Placed,
    r: int,
    c: int,
    dt: str,
    flow: Flow,
    order: Sequence[int],
    memo: dict[tuple, Any] | None = None,
) -> bool:
    """Core ``(r, c)``'s tile of product ``j``; ``order``: its weight pieces in the order they
    were preloaded (:mod:`lowering.elk_pieces`), each multiplied as it arrives.  ``memo`` (one
    per program builder): the instructions every core of a grid row but the first emits alike
    (the activation pieces received from the row's first core; :func:`lowering.elk_reduce.
    scatter`), made once per row and appended as the same objects."""
    m, k, n = pl.op.dims
    kb, nb = k // pl.rows, n // pl.cols
    nc = chunks(kb)
    rb = kb // nc
    acc, tmp = f"o{j}_p", f"o{j}_t"
    axis = pl.plan.scatter
    if axis < 0:
        p.alloc(acc, (m, nb), dt)
        if _has_tmp(pl.rows, r):
            p.alloc(tmp, (m, nb), dt)
    chan = f"o{j}_a{r}"
    if pl.cols > 1 and not b.has_channel(chan):
        row = pl.cores[r * pl.cols : (r + 1) * pl.cols]
        b.channel(chan, row[0], row[1:], depth=nc)
    # activation pieces: loaded by the row's first core, multicast along it
    run = None if c == 0 or memo is None else memo.get(("recv", j, r))
    if run is not None:
        p.extend(run)
    else:
        start = p.size()
        for q in range(nc):
            a = f"o{j}_a{q}"
            p.alloc(a, (m, rb), dt)
            if c == 0:
                flow.get(p, j, a, pl.op.tensor("x"), (0, r * kb + q * rb), (m, rb))
                if pl.cols > 1:
                    p.send(chan, a)
            else:
                p.recv(chan, a)
        if c and memo is not None:
            memo[("recv", j, r)] = p.emitted(start)
    if axis >= 0:
        return scatter(b, p, j, pl, r, c, dt, flow, axis, order, memo)
    for q in order:
        a, w = f"o{j}_a{q}", f"o{j}_w{q}"
        if q == order[0]:
            p.compute("matmul", acc, (a, w), dtype=dt)
        else:
            p.compute("matmul_acc", acc, (a, w, acc), dtype=dt)
        p.free(a)
        p.free(w)
    step = 1
    finisher = r == 0
    while step < pl.rows:  # pairwise tree reduction down the grid column
        if r % (2 * step) == step:
            ch = f"o{j}_r{step}_{r}_{c}"
            if not b.has_channel(ch):
                b.channel(ch, pl.core(r, c), pl.core(r - step, c))
            p.send(ch, acc)
            break
        if r % (2 * step) == 0 and r + step < pl.rows:
            ch = f"o{j}_r{step}_{r + step}_{c}"
            if not b.has_channel(ch):
                b.channel(ch, pl.core(r + step, c), pl.core(r, c))
            p.recv(ch, tmp)
            p.compute("add", acc, (acc, tmp), dtype=dt)
        step *= 2
    if finisher:
        flow.put(p, j, acc, pl.op.tensor("y"), (0, c * nb), (m, nb))
    p.free(acc)
    if _has_tmp(pl.rows, r):
        p.free(tmp)
    return finisher


def _has_tmp(rows: int, r: int) -> bool:
    """Whether grid row ``r`` receives at least one partial sum in the tree reduction."""
    return r % 2 == 0 and r + 1 < rows


def _attention(
    b: ProgramBuilder,
    p: CoreBuilder,
    j: int,
    pl: Placed,
    r: int,
    c: int,
    dt: str,
    flow: Flow,
    order: Sequence[int],
) -> bool:
    op = pl.op
    bsz, hq, hkv, d, length = op.dims
    tb, tg, ts = pl.plan.tiles
    g = hq // hkv
    ib, ig = divmod(r, tg)
    bb, hb = bsz // tb, hkv // tg
    q, part, tmp = f"o{j}_q", f"o{j}_s", f"o{j}_u"
    p.alloc(q, (bb, hb * g, d), dt)
    p.alloc(part, (bb, hb * g, d + 2), "fp32")
    flow.get(p, j, q, op.tensor("q"), (ib * bb, ig * hb * g, 0), (bb, hb * g, d))
    params = {"group": g, "scale": 1.0 / math.sqrt(d)}
    nc = chunks(length // ts)
    o0 = order[0]  # the KV pieces in the order they were preloaded (lowering.elk_pieces)
    p.compute("attn_partial", part, (q, f"o{j}_k{o0}", f"o{j}_v{o0}"), params, dt)
    if nc > 1:
        p.alloc(f"o{j}_w", (bb, hb * g, d + 2), "fp32")
    for ch_ in order[1:]:
        p.compute("attn_partial", f"o{j}_w", (q, f"o{j}_k{ch_}", f"o{j}_v{ch_}"), params, dt)
        p.compute("attn_merge", part, (part, f"o{j}_w"), dtype="fp32")
    if nc > 1:
        p.free(f"o{j}_w")
    roles = dict(op.tensors)
    if c == 0:
        if "kn" in roles:  # the new token's key and value, appended to the cache this step
            kn, vn = f"o{j}_kn", f"o{j}_vn"
            p.alloc(kn, (bb, hb, 1, d), dt)
            p.alloc(vn, (bb, hb, 1, d), dt)
            p.alloc(tmp, (bb, hb * g, d + 2), "fp32")
            flow.get(p, j, kn, roles["kn"], (ib * bb, ig * hb, 0, 0), (bb, hb, 1, d))
            flow.get(p, j, vn, roles["vn"], (ib * bb, ig * hb, 0, 0), (bb, hb, 1, d))
            p.compute("attn_partial", tmp, (q, kn, vn), params, dt)
            p.compute("attn_merge", part, (part, tmp), dtype="fp32")
            p.free(kn)
            p.free(vn)
        elif ts > 1:
            p.alloc(tmp, (bb, hb * g, d + 2), "fp32")
        for src in range(1, ts):
            ch = f"o{j}_s{r}_{src}"
            if not b.has_channel(ch):
                b.channel(ch, pl.core(r, src), pl.core(r, 0))
            p.recv(ch, tmp)
            p.compute("attn_merge", part, (part, tmp), dtype="fp32")
        out = f"o{j}_o"
        p.alloc(out, (bb, hb * g, d), dt)
        p.compute("attn_finish", out, (part,), dtype="fp32")
        flow.put(p, j, out, op.tensor("o"), (ib * bb, ig * hb * g, 0), (bb, hb * g, d))
        p.free(out)
        if "kn" in roles or ts > 1:
            p.free(tmp)
    else:
        ch = f"o{j}_s{r}_{c}"
        if not b.has_channel(ch):
            b.channel(ch, pl.core(r, c), pl.core(r, 0))
        p.send(ch, part)
    for buf in (q, part):
        p.free(buf)
    for ch_ in range(nc):
        p.free(f"o{j}_k{ch_}")
        p.free(f"o{j}_v{ch_}")
    return c == 0


def _vector(
    b: ProgramBuilder,
    p: CoreBuilder,
    j: int,
    pl: Placed,
    r: int,
    c: int,
    dt: str,
    shapes: Mapping[str, tuple[tuple[int, ...], str]],
    flow: Flow,
) -> bool:
    op = pl.op
    roles = dict(op.tensors)
    if op.node is not None:  # a layer-graph node on one core: whole tensors in and out
        ins = [name for role, name in op.tensors if role.startswith("in")]
        outs = [name for role, name in op.tensors if role.startswith("out")]
        bufs_in, bufs_out = [], []
        for k, t in enumerate(ins):
            buf = f"o{j}_i{k}"
            p.alloc(buf, shapes[t][0], shapes[t][1])
            flow.get(p, j, buf, t)
            bufs_in.append(buf)
        for k, t in enumerate(outs):
            buf = f"o{j}_x{k}"
            p.alloc(buf, shapes[t][0], shapes[t][1])
            bufs_out.append(buf)
        p.compute("layer_node", bufs_out, bufs_in, {"node": op.node}, dt)
        for buf, t in zip(bufs_out, outs):
            flow.put(p, j, buf, t)
        for buf in bufs_in + bufs_out:
            p.free(buf)
        return True
    rows, cols = op.dims
    rb, cb = rows // pl.rows, cols // pl.cols
    x, y = f"o{j}_x", f"o{j}_y"
    p.alloc(x, (rb, cb), dt)
    p.alloc(y, (rb, cb), dt)
    flow.get(p, j, x, roles["x"], (r * rb, c * cb), (rb, cb))
    if op.row_reduce and pl.cols > 1:
        # per-row partial statistics to the grid row's first core, the combined one back
        s = f"o{j}_s"
        p.alloc(s, (rb, 1), "fp32")
        p.compute("elk_vector", s, (s,), {"fpe": op.flops_per_elem * cb}, "fp32")
        back = f"o{j}_b{r}"
        if c == 0:
            if not b.has_channel(back):
                b.channel(back, pl.core(r, 0), [pl.core(r, k) for k in range(1, pl.cols)])
            for k in range(1, pl.cols):
                ch = f"o{j}_g{r}_{k}"
                if not b.has_channel(ch):
                    b.channel(ch, pl.core(r, k), pl.core(r, 0))
                p.recv(ch, s)
            p.send(back, s)
        else:
            ch = f"o{j}_g{r}_{c}"
            if not b.has_channel(ch):
                b.channel(ch, pl.core(r, c), pl.core(r, 0))
            p.send(ch, s)
            if not b.has_channel(back):
                b.channel(back, pl.core(r, 0), [pl.core(r, k) for k in range(1, pl.cols)])
            p.recv(back, s)
        p.free(s)
    p.compute("elk_vector", y, (x,), {"fpe": op.flops_per_elem}, dt)
    flow.put(p, j, y, roles["y"], (r * rb, c * cb), (rb, cb))
    p.free(x)
    p.free(y)
    return True


def _finishes(pl: Placed, r: int, c: int) -> bool:
    """Whether core ``(r, c)`` of ``pl`` writes part of the operator's output (what its kernel
    emitter returns): every core of a reduce-scattered product or a vector operator, the top
    grid row of a product reduced by a tree, the first column of an attention grid."""
    kind = pl.op.kind
    if kind == "matmul":
        return pl.plan.scatter >= 0 or r == 0
    if kind == "attention":
        return c == 0
    return True


def _report(
    b: ProgramBuilder, p: CoreBuilder, i: int, pl: Placed, r: int, c: int, ctrl: int
) -> bool:
    """Core ``(r, c)``, done with its tile of operator ``i``, reports it (ELK §4.5's one-way
    synchronisation).  The finishing cores of a grid row report through the row's first
    finishing core, which waits for the others' tokens and sends one to the controller ``ctrl``,
    so the controller's port takes one token per grid row rather than one per core (a
    reduce-scattered product or a vector operator finishes on every core: thousands of tokens
    on the four-chip set-up).  Returns whether this core reports to the controller."""
    first = next(k for k in range(pl.cols) if _finishes(pl, r, k))
    core = pl.core(r, c)
    if c != first:
        ch = f"done{i}_{core}"
        if not b.has_channel(ch):
            b.channel(ch, core, pl.core(r, first))
        p.send_value(ch, 1)
        return False
    for k in range(c + 1, pl.cols):
        if _finishes(pl, r, k):
            ch = f"done{i}_{pl.core(r, k)}"
            if not b.has_channel(ch):
                b.channel(ch, pl.core(r, k), core)
            p.recv_value(ch, "d")
    ch = f"done{i}_{core}"
    b.channel(ch, core, ctrl)
    p.send_value(ch, 1)
    return True


def elk_programs(
    chip: Chip,
    ops: Sequence[Operator],
    plans: Sequence[Plan],
    order: Sequence[int],
    issued: Sequence[int],
    tensors: Mapping[str, tuple[tuple[int, ...], str]],
    *,
    name: str = "elk",
    links: Mapping[str, str] | None = None,
    results: Collection[str] = (),
    layers: bool = True,
) -> ProgramSet:
    """Per-core programs of an ELK plan: ``plans[i]`` executes ``ops[i]``; ``order`` is the
    preload order and ``issued[i]`` the number of preloads issued before ``execute(i)``.
    Activations stay on chip between operators (:mod:`lowering.elk_flow`); ``results`` are
    tensors stored to HBM even when a later operator reads them on chip, ``links`` consumer
    tensors that are the leading columns of a producer tensor.  ``layers``: the sections of
    equal stacked layers are emitted once and copied (:mod:`lowering.elk_layers`; the same
    program set, ``False`` emits every section)."""
    n = len(ops)
    if not (len(plans) == len(issued) == len(order) == n):
        raise ProgramError("elk_programs: ops, plans, order and issued must have equal lengths")
    placed = place(chip, ops, plans, order, issued)
    flow = Flow(tensors, dict(links or {}), frozenset(results))
    lay = None
    if layers:
        lay = find_layering(ops, placed, order, issued, tensors, flow.links, flow.results, flow)
    _emit(RecordingBuilder(name), chip, ops, placed, order, issued, tensors, flow, lay)
    b = ProgramBuilder(name, share=True)
    flow.plan(b)
    _emit(b, chip, ops, placed, order, issued, tensors, flow, lay)
    flow.done()
    b.meta("order", " ".join(str(o) for o in order))
    b.meta("issued", " ".join(str(x) for x in issued))
    ps = b.build()
    return lay.attach(ps) if lay is not None else ps  # copies marked (runtime.program_layers)


def _emit(
    b: ProgramBuilder,
    chip: Chip,
    ops: Sequence[Operator],
    placed: Sequence[Placed],
    order: Sequence[int],
    issued: Sequence[int],
    tensors: Mapping[str, tuple[tuple[int, ...], str]],
    flow: Flow,
    lay: Layering | None = None,
) -> None:
    n = len(ops)
    ctrl = chip.num_cores - 1
    for t, (shape, dtype) in tensors.items():
        b.tensor(t, shape, dtype)
    tiles: dict[int, list[tuple[int, int, int]]] = {}
    for i, pl in enumerate(placed):
        for r in range(pl.rows):
            for c in range(pl.cols):
                tiles.setdefault(pl.core(r, c), []).append((i, r, c))
    workers = sorted(tiles)
    if ctrl in tiles:
        raise ProgramError(f"core {ctrl} is the controller; no tile may be placed on it")
    by_core_op = {core: {i: (r, c) for i, r, c in ts} for core, ts in tiles.items()}
    finishers: list[list[int]] = [[] for _ in range(n)]
    # Which sections (``go_i`` .. ``go_{i+1}``) each core has work in: a core waits for ``go_i``
    # only when it preloads or executes something in section ``i``.
    sections: dict[int, list[int]] = {}
    prev = 0
    for i in range(n):
        for k in range(prev, issued[i]):
            for core in placed[order[k]].cores:
                sections.setdefault(core, []).append(i)
        prev = max(prev, issued[i])
        for core in placed[i].cores:
            sections.setdefault(core, []).append(i)
    listeners: list[list[int]] = [[] for _ in range(n)]
    for core, secs in sections.items():
        for i in sorted(set(secs)):
            if i > 0:
                listeners[i].append(core)
    for i in range(1, n):
        if listeners[i]:
            b.channel(f"go{i}", ctrl, sorted(listeners[i]))
    first = [0] * n  # the preloads of section i are at positions first[i] .. issued[i]-1
    for i in range(1, n):
        first[i] = max(first[i - 1], issued[i - 1])
    rot = [rotates(chip.hbm, pl) for pl in placed]
    memo: dict[tuple, Any] = {}  # instructions the cores of a grid row emit alike (_matmul)
    # the recording pass keeps only the activation loads and stores (Flow) and the layering's
    # records: the preloads and the reports to the controller are not made there
    rec = isinstance(b, RecordingBuilder)
    source = lay.source if lay is not None else [-1] * n
    template = lay.template if lay is not None else [False] * n
    held = lay.held(b) if lay is not None else ()
    for core in workers:
        p = b.core(core)
        mine = by_core_op[core]
        busy = set(sections.get(core, ()))
        for i in range(n):
            if source[i] >= 0:
                if (core, source[i]) in held:
                    assert lay is not None
                    lay.replay(b, p, i, finishers)
                continue
            mark = lay.mark(b, p) if template[i] and lay is not None else None
            if i > 0 and i in busy:
                p.recv_value(f"go{i}", "go")
            for k in range(first[i], issued[i]) if not rec else ():
                jj = order[k]
                if jj in mine:
                    r, c = mine[jj]
                    order_j = piece_order(placed[jj], r, c, rot[jj])
                    _preload(p, jj, placed[jj], r, c, ops[jj].dtype, order_j)
            fin = False
            if i in mine:
                r, c = mine[i]
                pl = placed[i]
                dt = ops[i].dtype
                order_i = piece_order(pl, r, c, rot[i])
                if pl.op.kind == "matmul":
                    fin = _matmul(b, p, i, pl, r, c, dt, flow, order_i, memo)
                elif pl.op.kind == "attention":
                    fin = _attention(b, p, i, pl, r, c, dt, flow, order_i)
                else:
                    fin = _vector(b, p, i, pl, r, c, dt, tensors, flow)
                if fin != _finishes(pl, r, c):
                    raise ProgramError(f"operator {i}: core ({r}, {c}) finishing is {fin}")
                fin = fin and i < n - 1 and not rec and _report(b, p, i, pl, r, c, ctrl)
                if fin:
                    finishers[i].append(core)
            if mark is not None:
                assert lay is not None
                lay.capture(b, p, i, mark, fin)
    cp = b.core(ctrl)
    for i in range(n - 1):
        # the controller's section of a copied operator is its template's renamed when it
        # hears from the same cores and starts the same ones (ELK §4.4: equal layers)
        src = source[i]
        if src >= 0 and finishers[i] == finishers[src] and listeners[i + 1] == listeners[src + 1]:
            if (ctrl, src) in held:
                assert lay is not None
                lay.replay(b, cp, i, finishers)
            continue
        mark = lay.mark(b, cp) if template[i] and lay is not None else None
        for core in finishers[i]:
            cp.recv_value(f"done{i}_{core}", "d")
        if listeners[i + 1]:  # a token (its channel names the operator), 1 in every layer
            cp.send_value(f"go{i + 1}", 1)
        if mark is not None:
            assert lay is not None
            lay.capture(b, cp, i, mark, False)
