"""Find the symmetry blocks of any PyTorch model (SPEC §3).

:func:`find_symmetries` walks the modules of a model, asks the adapters of
:mod:`geosharp.symmetry.adapters` which blocks each one holds (as parameter slices), adds the
blocks and pairs the user declared, and turns every spec into its block with global flat
indices into ``θ = cat([p.reshape(-1) for p in trainable params])``: the block class registered
for the spec's type builds it (:func:`~geosharp.symmetry.blocks.block_from_spec`), reading the
positions from :class:`_Resolver`. No coordinate may belong to two blocks; whatever no block
claims uses the adaptive geometry.

Finding only claims: :func:`~geosharp.symmetry.verify.prove` then proves the claims of a space
on a batch, and drops those that do not hold.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.symmetry.adapters import ADAPTERS, Adapter
from geosharp.symmetry.blocks import SymmetryBlock, block_from_spec
from geosharp.symmetry.positions import Positions, recipe_views
from geosharp.symmetry.space import UNPROVEN_NOTE, ParameterSpace
from geosharp.symmetry.specs import Claim, PairSpec, ParamSlice

__all__ = ["find_symmetries"]

#: At most this many module paths are listed after a note shared by many modules.
_MAX_PATHS_IN_NOTE = 3


class _FrozenParameterError(ValueError):
    """A block refers to a parameter with ``requires_grad=False``."""


class _Resolver:
    """Maps parameter names (including aliases of tied weights) to flat positions.

    The :class:`~geosharp.symmetry.blocks.Coordinates` of one model's trainable parameters.
    """

    def __init__(self, model: nn.Module) -> None:
        canonical: dict[int, str] = {}
        self.included: list[tuple[str, nn.Parameter]] = []
        self.excluded: dict[str, str] = {}
        for name, p in model.named_parameters():
            canonical[id(p)] = name
            if p.requires_grad:
                self.included.append((name, p))
            else:
                self.excluded[name] = "requires_grad=False (frozen)"
        self.canonical = {
            alias: canonical[id(p)] for alias, p in model.named_parameters(remove_duplicate=False)
        }
        self.offsets: dict[str, int] = {}
        self.shapes: dict[str, torch.Size] = {}
        offset = 0
        for name, p in self.included:
            self.offsets[name] = offset
            self.shapes[name] = p.shape
            offset += p.numel()
        self.numel = offset

    def name(self, alias: str, owner: str) -> str:
        if alias not in self.canonical:
            raise ValueError(
                f"{owner} refers to {alias!r}, which is not a parameter of the model; "
                "use the names of model.named_parameters()"
            )
        name = self.canonical[alias]
        if name in self.excluded:
            raise _FrozenParameterError(
                f"{owner} refers to parameter {name!r}, which is excluded "
                f"({self.excluded[name]}); unfreeze it or leave the block out"
            )
        return name

    def shape(self, name: str) -> torch.Size:
        return self.shapes[name]

    def whole(self, name: str) -> Positions:
        return Positions.arange(self.offsets[name], self.shapes[name], self.numel)

    def slices(
        self, pieces: Sequence[ParamSlice], heads: int, head_dim: int, owner: str
    ) -> Positions:
        """Global positions of slices cut into ``heads`` blocks of ``head_dim``, row-stacked.

        Kept as a recipe (:class:`~geosharp.symmetry.positions.Positions`): built once here to
        check the slices, then again whenever a caller reads them.
        """
        parts = []
        for piece in pieces:
            name = self.name(piece.param, owner)
            parts.append((self.shapes[name], piece, self.offsets[name]))
        return Positions.slices(parts, heads, head_dim, self.numel)


def _as_pair_spec(pair: PairSpec | tuple[str, str]) -> PairSpec:
    if not isinstance(pair, tuple):
        return pair
    u, v = pair
    return PairSpec(f"[{u}*{v}]", u, v)


def _collapse_notes(notes: list[tuple[str, str]]) -> list[str]:
    """Merge identical notes of many modules into one line listing (some of) the modules."""
    by_text: dict[str, list[str]] = {}
    for path, text in notes:
        by_text.setdefault(text, []).append(path)
    out = []
    for text, paths in by_text.items():
        paths = [p for p in paths if p]
        if not paths:
            out.append(text)
        elif len(paths) <= _MAX_PATHS_IN_NOTE:
            out.append(f"{text} ({', '.join(paths)})")
        else:
            out.append(f"{text} ({len(paths)} modules: {paths[0]}, …, {paths[-1]})")
    return out


KEY_BIAS = ("quotient", "keep")


def _specs(claim: Claim, key_bias: str) -> list[Any]:
    """The specs of a claim; with ``key_bias="keep"`` key biases are rows of their QK block."""
    blocks = list(claim.blocks)
    translations = list(claim.translations)
    if key_bias == "keep":
        folded = []
        for t in translations:
            host = next((i for i, b in enumerate(blocks) if b.name == t.fold_into), None)
            if host is None:
                folded.append(t)
                continue
            blocks[host] = replace(blocks[host], h=(*blocks[host].h, *t.pieces))
        translations = folded
    ordered: list[Any] = []
    for b in blocks:  # each key bias right after its QK block, as in the module
        ordered.append(b)
        ordered.extend(t for t in translations if t.fold_into == b.name)
    ordered.extend(t for t in translations if t.fold_into not in {b.name for b in blocks})
    return [*ordered, *claim.pairs]


def find_symmetries(
    model: nn.Module,
    *,
    adapters: Sequence[Adapter] | None = None,
    extra_blocks: Iterable[Any] = (),
    diagonal_pairs: Iterable[PairSpec | tuple[str, str]] = (),
    key_bias: str = "quotient",
) -> ParameterSpace:
    """Split the trainable parameters of a model into symmetry blocks and the rest.

    Modules are visited in ``named_modules()`` order; the first adapter that recognises a module
    claims it (its submodules are not visited again, unless every block of the claim touches a
    frozen parameter: then the finder looks inside, e.g. for LoRA adapters under a frozen
    attention). Parameters with ``requires_grad=False`` are left out of ``θ`` and listed in
    :attr:`ParameterSpace.excluded`; a block found by an adapter that touches one is not used
    (its trainable coordinates stay adaptive, with a note), whereas a user-declared block that
    does raises. The blocks are claims: the space's notes say so until
    :func:`~geosharp.symmetry.verify.prove` has proven them on a batch.

    Args:
        model: Any ``nn.Module``.
        adapters: Adapters to try, in order (default: the registry
            :data:`geosharp.symmetry.adapters.ADAPTERS`; pass ``[]`` to use only the declared
            blocks).
        extra_blocks: Hand-declared block specs, e.g. from
            :func:`geosharp.symmetry.declare_block` (any spec type a block class builds).
        diagonal_pairs: Extra diagonal pairs, as :class:`PairSpec` or ``(u_name, v_name)``.
        key_bias: ``"quotient"`` (default): attention key biases the softmax ignores are
            translation blocks, held fixed by geodesic measures (SPEC §8); ``"keep"``: they are
            rows of ``H_QK`` as in geosharp ≤ 0.1 (the setting of Studies 1–3).

    Returns:
        The :class:`ParameterSpace`.

    Raises:
        ValueError: If two blocks (or pairs) claim the same coordinate, two blocks share a
            name, a declared block refers to a missing or frozen parameter, a slice does
            not fit its heads, or ``key_bias`` is unknown.
        TypeError: If no block class builds the type of a spec.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> mha = nn.MultiheadAttention(embed_dim=8, num_heads=2)
        >>> space = find_symmetries(mha)
        >>> [(b.name, b.heads, b.n, b.m, b.head_dim) for b in space.gl_blocks]
        [('<model>[QK]', 2, 9, 8, 4), ('<model>[VO]', 2, 9, 8, 4)]
        >>> [b.name for b in space.blocks if b.kind == "b_k"]
        ['<model>[b_k]']
        >>> space.adaptive_numel  # the output bias
        8
    """
    if key_bias not in KEY_BIAS:
        raise ValueError(f"key_bias must be one of {KEY_BIAS}, got {key_bias!r}")
    adapters = list(ADAPTERS if adapters is None else adapters)
    res = _Resolver(model)

    notes: list[tuple[str, str]] = []
    frozen: list[str] = []
    blocks: list[SymmetryBlock] = []
    claimed: list[str] = []
    for path, module in model.named_modules():
        if any(path == c or c == "" or path.startswith(c + ".") for c in claimed):
            continue
        for adapter in adapters:
            claim = adapter(path, module)
            if claim is None:
                continue
            specs = _specs(claim, key_bias)
            found, dropped = [], []
            for spec in specs:
                try:
                    found.append(block_from_spec(spec, res))
                except _FrozenParameterError:
                    dropped.append(spec.name)
            if specs and not found:
                # Everything here is frozen: look inside (a LoRA adapter may be trainable).
                frozen.extend(dropped)
                break
            notes.extend((path, text) for text in claim.notes)
            frozen.extend(dropped)
            blocks.extend(found)
            claimed.append(path)
            break
    for spec in extra_blocks:
        blocks.append(block_from_spec(spec, res))
    for pair in diagonal_pairs:
        blocks.append(block_from_spec(_as_pair_spec(pair), res))

    # How many claims each coordinate has, one byte each (an int64 owner per coordinate was
    # 8 bytes × P of host memory and 1-12 s to fill on a 335 M model): a parameter at a time in
    # one buffer when every block is parameter slices, else (or to name a clash) block by block
    once = _claimed_once(blocks, res)
    claims = _Claims(res)
    names: set[str] = set()
    for i, block in enumerate(blocks):
        if block.name in names:
            raise ValueError(f"two blocks are named {block.name!r}; block names must be unique")
        if not once:
            _claim_positions(claims, blocks[:i], block, res)
        names.add(block.name)

    text = _collapse_notes(notes)
    if frozen:
        shown = ", ".join(repr(n) for n in frozen[:3]) + (", …" if len(frozen) > 3 else "")
        text.append(
            f"{len(frozen)} symmetry block(s) not used because they touch frozen parameters "
            f"(requires_grad=False): {shown}; their trainable coordinates stay adaptive"
        )
    for cls in dict.fromkeys(type(b) for b in blocks):
        if cls.space_note:
            text.append(cls.space_note)
    text.extend(_unknown_attention_notes(model, claimed, blocks))
    if blocks:
        text.append(UNPROVEN_NOTE)
    # the coordinates in no block are derived from the blocks (ParameterSpace.rest_layout)
    return ParameterSpace(
        param_names=tuple(name for name, _ in res.included),
        shapes=tuple(p.shape for _, p in res.included),
        offsets=tuple(res.offsets[name] for name, _ in res.included),
        blocks=blocks,
        excluded=dict(res.excluded),
        notes=text,
    )


#: Class-name fragments of modules that look like attention.
_ATTENTION_NAMES = ("Attention", "SelfAttention", "MultiHead", "Attn")


def _unknown_attention_notes(
    model: nn.Module, claimed: list[str], blocks: list[SymmetryBlock]
) -> list[str]:
    """A note naming every attention-like class with trainable weights that no adapter took."""
    covered = {b.module for b in blocks}
    unknown: dict[str, str] = {}
    for path, module in model.named_modules():
        name = type(module).__name__
        if not any(tag.lower() in name.lower() for tag in _ATTENTION_NAMES):
            continue
        inside = any(path == c or c == "" or path.startswith(c + ".") for c in claimed)
        outer = any(m.startswith(path + ".") or m == path for m in covered if path)
        if inside or outer:
            continue
        if any(p.requires_grad for p in module.parameters()):
            unknown.setdefault(name, path)
    return [
        f"attention module {cls} (e.g. {path!r}) is not understood by any adapter: its "
        "weights stay adaptive; declare its blocks with declare_block if it has symmetries"
        for cls, path in unknown.items()
    ]


class _Claims:
    """How many blocks claim each coordinate, one byte each, a table per parameter.

    Only the parameters some block touches get a table (made when first touched): on a 1.1 B
    Llama 0.2 of the parameters, where one byte per coordinate of ``θ`` took 1.1 GB and 4 s.
    """

    def __init__(self, res: _Resolver) -> None:
        self._starts = sorted(
            (off, name) for name, off in res.offsets.items() if res.shapes[name].numel()
        )
        self._shapes = {off: res.shapes[name] for off, name in self._starts}
        self._tables: dict[int, Tensor] = {}

    def table(self, offset: int) -> Tensor | None:
        """The counts of the parameter starting at ``offset``, shaped like it."""
        shape = self._shapes.get(int(offset))
        if shape is None:
            return None
        if offset not in self._tables:
            self._tables[offset] = torch.zeros(shape, dtype=torch.uint8)
        return self._tables[offset]

    def _split(self, idx: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
        """``(selection, table, local positions)`` per parameter the positions ``idx`` lie in."""
        starts = torch.tensor([o for o, _ in self._starts], dtype=torch.long)
        owner = torch.searchsorted(starts, idx.to(torch.long), right=True) - 1
        out = []
        for k in torch.unique(owner).tolist():
            sel = owner == k
            off = self._starts[k][0]
            out.append((sel, self.table(off).view(-1), idx[sel].to(torch.long) - off))
        return out

    def read(self, idx: Tensor) -> Tensor:
        """The counts at the global positions ``idx``."""
        out = torch.zeros(idx.shape, dtype=torch.uint8)
        for sel, t, local in self._split(idx):
            out[sel] = t[local]
        return out

    def add(self, idx: Tensor) -> None:
        """Count one claim at every position of ``idx`` (a position listed twice: two)."""
        for _, t, local in self._split(idx):
            t.index_put_((local,), torch.ones((), dtype=t.dtype).expand(local.numel()), True)


def _claimed_once(blocks: Sequence[SymmetryBlock], res: _Resolver) -> bool:
    """Whether the blocks claim each coordinate at most once, known without a position.

    ``True`` only when every block is parameter slices (its
    :class:`~geosharp.symmetry.positions.Positions` recipes have views) and no coordinate is
    claimed twice. The claims are counted a parameter at a time, through views of one table
    reused for every parameter (the tables of every touched parameter at once were 0.2 GB of
    fresh pages on a 1.1 B Llama), each checked by one reduction. ``False`` otherwise: the
    blocks are then counted one by one (:func:`_claim_positions`), which names a clash.
    """
    shapes = {int(off): res.shapes[n] for n, off in res.offsets.items() if res.shapes[n].numel()}

    def meta(offset: int) -> Tensor | None:  # a parameter's shape, to view with no memory
        shape = shapes.get(int(offset))
        return None if shape is None else torch.empty(shape, dtype=torch.uint8, device="meta")

    users: dict[int, list[list]] = {}  # per parameter, the fields of the blocks touching it
    for block in blocks:
        fields = [getattr(block, f) for f in block.index_fields]
        touched: list[int] = []

        def seen(offset: int, touched: list[int] = touched) -> Tensor | None:
            touched.append(int(offset))
            return meta(offset)

        if recipe_views(fields, seen) is None:
            return False
        for off in dict.fromkeys(touched):
            users.setdefault(off, []).append(fields)
    most = max((shapes[o].numel() for o in users), default=0)
    scratch = torch.empty(most, dtype=torch.uint8, device="cpu")  # host bookkeeping, by name
    for off, claims in users.items():
        table = scratch[: shapes[off].numel()].zero_().view(shapes[off])

        def one(offset: int, off: int = off, table: Tensor = table) -> Tensor | None:
            return table if int(offset) == off else meta(offset)  # this parameter's, for real

        views = []
        for fields in claims:
            found = recipe_views(fields, one)
            if found is None:  # pragma: no cover - the same recipes had views above
                return False
            views.extend(v for v in found if not v.is_meta)
        if len(views) > 255:  # a count could wrap past 255
            return False
        for v in views:
            v.add_(1)
        if table.numel() and int(table.amax()) > 1:
            return False
    return True


def _claim_positions(
    claims: _Claims, earlier: list[SymmetryBlock], block: SymmetryBlock, res: _Resolver
) -> None:
    """Count ``block``'s coordinates in ``claims``; raise on any double claim.

    ``claims`` holds, per coordinate, how many of the ``earlier`` blocks claim it (0 or 1). A
    block of parameter slices (:class:`~geosharp.symmetry.positions.Positions` recipes) is
    counted through views of the tables (:func:`~geosharp.symmetry.positions.recipe_views`),
    with no position built; another one, or one whose count shows a clash, through its
    positions (one scatter-add, which shows a position the block lists twice as a count other
    than 1). Which earlier block clashes is looked up only when one does.
    """
    views = recipe_views([getattr(block, f) for f in block.index_fields], claims.table)
    if views is not None and not any(bool(v.any()) for v in views):
        for v in views:
            v.add_(1)
        # every count 1 where all were 0: each view's least and greatest count are 1 (two
        # reductions; ``(v == 1).all()`` made a mask per view and took 1.3 s on a 1.1 B Llama)
        if all(int(v.amin()) == 1 == int(v.amax()) for v in views if v.numel()):
            return
        for v in views:  # a coordinate claimed twice: undone, and named through the positions
            v.sub_(1)

    def where(pos: int) -> str:
        for pname, off in res.offsets.items():
            size = res.shapes[pname].numel()
            if off <= pos < off + size:
                rem, index = pos - off, []
                for dim in reversed(res.shapes[pname]):
                    index.append(rem % dim)
                    rem //= dim
                return f"parameter {pname!r} at index {tuple(reversed(index))}"
        return f"flat position {pos}"  # pragma: no cover

    idx = block.positions()
    clash = claims.read(idx) > 0
    if clash.any():
        pos = int(idx[clash][0])
        other = next(b.name for b in earlier if bool((b.positions() == pos).any()))
        raise ValueError(
            f"blocks {other!r} and {block.name!r} both claim {where(pos)}; each coordinate may "
            "belong to one block only — drop or narrow one of the declarations"
        )
    claims.add(idx)
    twice = claims.read(idx) != 1  # 2 or more (a count that wrapped past 255 reads other than 1)
    if twice.any():
        pos = int(idx[twice][0])
        raise ValueError(
            f"block {block.name!r} claims {where(pos)} twice (its G and H slices overlap); "
            "each coordinate may belong to one place only"
        )
