"""The chip's shared resources and the routes transfers take through them.

Resources (one integer id each, state kept in flat lists for speed): every directed mesh link,
every all-to-all injection and ejection port, every HBM channel.  A resource serves transfers one
at a time, first come first served by the cycle the transfer's head reaches it, for
``ceil(bytes / bytes_per_cycle)`` cycles (ELK §5: "packets that share one NoC link are
scheduled sequentially"; each link models "its latency and bandwidth").

A route is a tree of *stages*, plain tuples ``(res, lat, children, delivers, form)`` made by
:func:`stage` (``form`` says what follows the stage, derived from ``children``):

* ``res >= 0`` a resource; ``-1`` a pure delay (no contention); ``-2`` the HBM channels a request
  is split over (served in parallel, each FIFO; :mod:`runtime.layout`).
* ``lat``: cycles from the parent's start (the head) to this stage; the tail additionally
  constrains the end: ``end >= parent_end + lat`` (cut-through / wormhole switching: a stage
  starts as soon as the head arrives and the resource is free).
* ``delivers``: destination indices that have the whole payload when the stage ends.

Mesh routes are dimension-ordered (``xy``: along the row to the destination column, then along
the column; ``yx`` the other way).  A multicast follows the union of the unicast routes, so a link
shared by several destinations carries the payload once.  Uncontended, a message of ``B`` bytes
over ``h`` hops arrives after ``h * hop_latency + ceil(B / link_bytes_per_cycle)`` cycles.

All-to-all (ELK §2.1, the IPU exchange): a message occupies the sender's injection port, then
after ``latency_cycles`` each receiver's ejection port.  HBM controllers sit on the exchange
("cores communicate with HBM controllers via the interconnect", ELK §2.1), so HBM reads pass
the reader's ejection port and writes the writer's injection port.  A read first takes its slot
on the reader's ejection port (the port is private to the core, so slots are granted in issue
order), and only then is released to the HBM channels: the port paces each core's reads, so a
core with a slow port cannot fill the controllers' queues ahead of the others.  The read completes
at ``max(port slot end, last channel end) + hbm latency + exchange latency``.  On a mesh with
``hbm.attach_cores`` every channel's data travels the mesh between the channel's router and the
core; with no attach points the HBM is uniform and has no NoC hop.

Two traffic classes on an all-to-all chip (ELK §3.2, §4.3: preload and execute traffic share
the interconnect's and the HBM's bandwidth).  A read marked *background* (an ELK
``preload_async`` piece, :class:`lowering.isa.Load`) takes its slot on the reader's ejection port
in the cycles the port's ordinary traffic leaves free, and is released to the HBM when that slot
begins, where it is served in the cycles ordinary requests leave free: the exchange interleaves
packets, and a port or memory controller arbitrating between its traffic classes serves an
execute's packet or request ahead of queued preload ones.  At the HBM the background reads are
served from one pool of all channels (``Fabric.pool``; every tensor is sliced evenly over all
channels, ELK §6.1), first come first served among themselves at the channels' summed
bandwidth, each ordinary request taking its bytes' share of that bandwidth first.  Packets are small against the
messages (256 B take 62 cycles of a 4.1 B/cycle port), so the arbitration is modelled as fluid
(preemptive-resume): background transfers at a port are served first come first served among
themselves, one at a time; an ordinary reservation of the port that starts before the
background transfer in service has finished pushes that transfer's end back by the cycles it
holds the port (:meth:`runtime.transfer.Transfers._bg`).  A background read completes, as an
ordinary one, at ``max(port slot end, HBM end) + hbm latency + exchange latency``.  Ordinary traffic
never waits for background traffic, so a program without background reads runs exactly as
before; on a mesh a background read takes the ordinary route.
"""

from __future__ import annotations

from dataclasses import dataclass

from hwmodel.chip import AllToAllNoC, Chip, MeshNoC
from runtime.errors import SimulationError

__all__ = ["Fabric", "Stage", "stage", "RES_DELAY", "RES_HBM", "RES_WAKE", "RES_BG", "bg_stage"]

#: A stage: ``(res, lat, children, delivers, form)``; see the module docstring and :func:`stage`.
Stage = tuple

RES_DELAY = -1
RES_HBM = -2
#: a calendar entry that re-examines resource ``lat``'s background queue (no transfer)
RES_WAKE = -3
#: resource ``r`` taken as background traffic is the stage code ``RES_BG - r``
RES_BG = -4


#: a stage's ``form`` (the fifth entry, set by :func:`stage`): what follows it, so the one
#: reservation routine (:meth:`runtime.transfer.Transfers._stage`) tests one small int instead
#: of walking its children: none; one resource child, reserved by an event; one delay leaf
#: (every route's last hop), delivered when the stage ends; anything else; one HBM channels
#: child, reserved by an event or, when its head reaches it in the current cycle, at once
#: (:attr:`runtime.transfer.Transfers.inline_hbm`)
FORM_LEAF, FORM_NEXT, FORM_LAST, FORM_TREE, FORM_HBM = 0, 1, 2, 3, 4


def stage(res: int, lat: int, children: tuple, delivers: tuple[int, ...]) -> Stage:
    """The stage ``(res, lat, children, delivers, form)`` (module docstring; ``form``: see
    :data:`FORM_LEAF`)."""
    if not children:
        form = FORM_LEAF
    elif len(children) > 1:
        form = FORM_TREE
    elif children[0][0] == RES_HBM:
        form = FORM_HBM
    elif children[0][0] != RES_DELAY:
        form = FORM_NEXT
    elif children[0][2]:
        form = FORM_TREE
    else:
        form = FORM_LAST
    return (res, lat, children, delivers, form)


def bg_stage(res: int, lat: int, children: tuple, delivers: tuple[int, ...]) -> Stage:
    """A stage taking resource ``res`` as background traffic (module docstring): its
    ``children`` are released when its service begins, ``delivers`` get the payload ``lat``
    cycles after it ends."""
    return stage(RES_BG - res, lat, children, delivers)


_DIRS = {(0, 1): "E", (0, -1): "W", (1, 0): "S", (-1, 0): "N"}


@dataclass(frozen=True, slots=True)
class _Res:
    name: str
    kind: str  # "link", "inject", "eject", "hbm"
    rate: float


class Fabric:
    """Resources of one chip plus route construction (cached per endpoint set)."""

    def __init__(self, chip: Chip) -> None:
        self.chip = chip
        self.noc = chip.noc
        self.res: list[_Res] = []
        self.links: dict[tuple[int, int], int] = {}
        self.inject: list[int] = []
        self.eject: list[int] = []
        hbm = chip.hbm
        if hbm.bytes_per_cycle_per_channel <= 0:
            raise SimulationError("hbm.bytes_per_cycle_per_channel must be positive")
        if isinstance(self.noc, MeshNoC):
            if self.noc.rows * self.noc.cols != chip.num_cores:
                raise SimulationError(
                    f"chip {chip.name!r}: mesh {self.noc.rows}x{self.noc.cols} does not hold "
                    f"num_cores={chip.num_cores}; make rows*cols equal the core count"
                )
            if self.noc.link_bytes_per_cycle <= 0:
                raise SimulationError("noc.link_bytes_per_cycle must be positive")
            rows, cols = self.noc.rows, self.noc.cols
            for n in range(chip.num_cores):
                r, c = divmod(n, cols)
                for (dr, dc), name in _DIRS.items():
                    rr, cc = r + dr, c + dc
                    if 0 <= rr < rows and 0 <= cc < cols:
                        m = rr * cols + cc
                        self.links[(n, m)] = self._add(
                            f"link r{r}c{c}->r{rr}c{cc} ({name})",
                            "link",
                            self.noc.link_bytes_per_cycle,
                        )
            if hbm.attach_cores and len(hbm.attach_cores) != hbm.channels:
                raise SimulationError(
                    f"hbm.attach_cores lists {len(hbm.attach_cores)} cores for {hbm.channels} "
                    f"channels; give one core per channel or leave it empty"
                )
            if any(not 0 <= a < chip.num_cores for a in hbm.attach_cores):
                raise SimulationError(f"hbm.attach_cores {hbm.attach_cores} names a missing core")
        elif isinstance(self.noc, AllToAllNoC):
            if self.noc.injection_bytes_per_cycle <= 0 or self.noc.ejection_bytes_per_cycle <= 0:
                raise SimulationError("all-to-all port bandwidths must be positive")
            for n in range(chip.num_cores):
                self.inject.append(
                    self._add(f"inject core {n}", "inject", self.noc.injection_bytes_per_cycle)
                )
            for n in range(chip.num_cores):
                self.eject.append(
                    self._add(f"eject core {n}", "eject", self.noc.ejection_bytes_per_cycle)
                )
        else:  # pragma: no cover - NoC is a closed union
            raise SimulationError(f"unknown NoC {self.noc!r}")
        self.chan_res = [
            self._add(f"hbm channel {c}", "hbm", hbm.bytes_per_cycle_per_channel)
            for c in range(hbm.channels)
        ]
        self.attached = isinstance(self.noc, MeshNoC) and bool(hbm.attach_cores)
        #: the id past the resources: the HBM channels pooled for background reads
        self.pool = len(self.res)
        self._load_cache: dict[int, object] = {}
        self._eject_leaf: dict[int, Stage] = {}  # (message_roots)
        self._store_cache: dict[int, object] = {}
        self._bg_cache: dict[int, object] = {}

    def _add(self, name: str, kind: str, rate: float) -> int:
        self.res.append(_Res(name, kind, float(rate)))
        return len(self.res) - 1

    # -- mesh geometry ------------------------------------------------------------------------

    def path(self, src: int, dst: int) -> list[int]:
        """Link ids from ``src``'s router to ``dst``'s router (dimension-order routing)."""
        noc = self.noc
        assert isinstance(noc, MeshNoC)
        cols = noc.cols
        r, c = divmod(src, cols)
        r2, c2 = divmod(dst, cols)
        links = self.links
        out: list[int] = []
        node = src
        for axis in ("col", "row") if noc.routing == "xy" else ("row", "col"):
            if axis == "col":
                step = 1 if c2 > c else -1
                for _ in range(abs(c2 - c)):
                    out.append(links[(node, node + step)])
                    node += step
            else:
                step = cols if r2 > r else -cols
                for _ in range(abs(r2 - r)):
                    out.append(links[(node, node + step)])
                    node += step
        return out

    def hops(self, src: int, dst: int) -> int:
        """Mesh hop count (0 on all-to-all)."""
        return len(self.path(src, dst)) if isinstance(self.noc, MeshNoC) else 0

    # -- routes -------------------------------------------------------------------------------

    def message_roots(self, src: int, dsts: tuple[int, ...]) -> tuple[Stage, ...]:
        """Root stages of a message from ``src`` to ``dsts`` (delivery index = position)."""
        noc = self.noc
        if len(dsts) == 1 and dsts[0] != src and noc.__class__ is AllToAllNoC:
            # a unicast message (most channels): the destination's ejection stage is shared
            # by every source's route to it
            d = dsts[0]
            leaf = self._eject_leaf.get(d)
            if leaf is None:
                leaf = self._eject_leaf[d] = stage(self.eject[d], noc.latency_cycles, (), (0,))
            return (stage(self.inject[src], 0, (leaf,), ()),)
        roots: list[Stage] = []
        if isinstance(noc, AllToAllNoC):
            children = tuple(
                stage(self.eject[d], noc.latency_cycles, (), (i,))
                for i, d in enumerate(dsts)
                if d != src
            )
            if children:
                roots.append(stage(self.inject[src], 0, children, ()))
        else:
            paths = [(self.path(src, d), i) for i, d in enumerate(dsts) if d != src]
            roots.extend(_trie(paths, 0, noc.hop_latency_cycles))
        roots.extend(stage(RES_DELAY, 0, (), (i,)) for i, d in enumerate(dsts) if d == src)
        return tuple(roots)

    def load_roots(self, core: int) -> object:
        """HBM -> core route: a root stage of kind ``RES_HBM`` (joined channels) or, on a mesh
        with attach points, a per-channel tuple of root stages."""
        hit = self._load_cache.get(core)
        if hit is None:
            hbm = self.chip.hbm
            noc = self.noc
            if isinstance(noc, AllToAllNoC):
                # The ejection port paces the core's reads: a read is released to the HBM
                # controllers when the port is free to take its data (see module docstring).
                done = stage(RES_DELAY, hbm.latency_cycles + noc.latency_cycles, (), (0,))
                hit = stage(self.eject[core], 0, (stage(RES_HBM, 0, (done,), ()),), ())
            elif not self.attached:
                hit = stage(RES_HBM, 0, (stage(RES_DELAY, hbm.latency_cycles, (), (0,)),), ())
            else:
                per: list[Stage] = []
                for c, a in enumerate(hbm.attach_cores):
                    links = self.path(a, core)
                    if not links:
                        child: Stage = stage(RES_DELAY, hbm.latency_cycles, (), (0,))
                    else:
                        child = _chain(
                            links,
                            hbm.latency_cycles,
                            noc.hop_latency_cycles,
                            stage(RES_DELAY, noc.hop_latency_cycles, (), (0,)),
                        )
                    per.append(stage(self.chan_res[c], 0, (child,), ()))
                hit = tuple(per)
            self._load_cache[core] = hit
        return hit

    def background_roots(self, core: int) -> object:
        """HBM -> core route of a background read (module docstring): the joined channels,
        then the core's ejection port as background traffic; on a mesh :meth:`load_roots`."""
        if not isinstance(self.noc, AllToAllNoC):
            return self.load_roots(core)
        hit = self._bg_cache.get(core)
        if hit is None:
            lat = self.chip.hbm.latency_cycles + self.noc.latency_cycles
            chans = bg_stage(self.pool, lat, (), (0,))
            hit = bg_stage(self.eject[core], lat, (chans,), (0,))
            self._bg_cache[core] = hit
        return hit

    def store_roots(self, core: int) -> object:
        """Core -> HBM route, shaped like :meth:`load_roots`."""
        hit = self._store_cache.get(core)
        if hit is None:
            hbm = self.chip.hbm
            noc = self.noc
            done = stage(RES_DELAY, hbm.latency_cycles, (), (0,))
            if isinstance(noc, AllToAllNoC):
                hit = stage(
                    self.inject[core], 0, (stage(RES_HBM, noc.latency_cycles, (done,), ()),), ()
                )
            elif not self.attached:
                hit = stage(RES_HBM, 0, (done,), ())
            else:
                per: list[Stage] = []
                for c, a in enumerate(hbm.attach_cores):
                    links = self.path(core, a)
                    chan = stage(
                        self.chan_res[c], noc.hop_latency_cycles if links else 0, (done,), ()
                    )
                    per.append(_chain(links, 0, noc.hop_latency_cycles, chan) if links else chan)
                hit = tuple(per)
            self._store_cache[core] = hit
        return hit


def _chain(links: list[int], first_lat: int, hop_lat: int, tail: Stage) -> Stage:
    """Stages ``links[0] -> links[1] -> ... -> tail`` (``tail`` carries its own latency)."""
    st = tail
    for i in range(len(links) - 1, -1, -1):
        st = stage(links[i], first_lat if i == 0 else hop_lat, (st,), ())
    return st


def _trie(paths: list[tuple[list[int], int]], first_lat: int, hop_lat: int) -> list[Stage]:
    """Merge link paths sharing a prefix into a tree (multicast); each path ends in a delay
    stage of ``hop_lat`` that delivers its destination index."""
    node: dict = {}
    for links, idx in paths:
        cur = node
        for lid in links:
            cur = cur.setdefault(lid, {})
        cur.setdefault(None, []).append(idx)

    def build(tree: dict, lat: int) -> list[Stage]:
        out: list[Stage] = []
        for lid, sub in tree.items():
            if lid is None:
                continue
            kids = build(sub, hop_lat)
            kids.extend(stage(RES_DELAY, hop_lat, (), (i,)) for i in sub.get(None, ()))
            out.append(stage(lid, lat, tuple(kids), ()))
        return out

    return build(node, first_lat)
