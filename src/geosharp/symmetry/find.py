"""Find the symmetry blocks of any PyTorch model (SPEC §3).

:func:`find_symmetries` walks the modules of a model, asks the adapters of
:mod:`geosharp.symmetry.adapters` which blocks each one holds (as parameter slices), adds the
blocks and pairs the user declared, and turns everything into global flat indices into
``θ = cat([p.reshape(-1) for p in trainable params])`` with one generic code path. No
coordinate may belong to two blocks; whatever no block claims uses the adaptive geometry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from geosharp.symmetry.adapters import ADAPTERS, Adapter
from geosharp.symmetry.space import DiagonalPair, GLBlock, ParameterSpace
from geosharp.symmetry.specs import BlockSpec, Claim, PairSpec, slice_positions

__all__ = ["find_symmetries"]

#: At most this many module paths are listed after a note shared by many modules.
_MAX_PATHS_IN_NOTE = 3


class _FrozenParameterError(ValueError):
    """A block refers to a parameter with ``requires_grad=False``."""


class _Resolver:
    """Maps parameter names (including aliases of tied weights) to flat positions."""

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

    def block(self, spec: BlockSpec) -> GLBlock:
        def pieces(slices: Sequence) -> Tensor:
            parts = []
            for piece in slices:
                name = self.name(piece.param, f"block {spec.name!r}")
                local = slice_positions(self.shapes[name], piece, spec.heads, spec.head_dim)
                parts.append(local + self.offsets[name])
            return torch.cat(parts, dim=1)

        return GLBlock(
            name=spec.name,
            kind=spec.kind,
            module=spec.module,
            heads=spec.heads,
            head_dim=spec.head_dim,
            g_index=pieces(spec.g),
            h_index=pieces(spec.h),
        )

    def pair(self, spec: PairSpec) -> DiagonalPair:
        u = self.name(spec.u, f"diagonal pair {spec.name!r}")
        v = self.name(spec.v, f"diagonal pair {spec.name!r}")
        if self.shapes[u] != self.shapes[v]:
            raise ValueError(
                f"diagonal pair {spec.name!r}: {u!r} has shape {tuple(self.shapes[u])} but "
                f"{v!r} has shape {tuple(self.shapes[v])}; u and v must match"
            )

        def positions(name: str) -> Tensor:
            n = self.shapes[name].numel()
            return torch.arange(n, dtype=torch.long).view(self.shapes[name]) + self.offsets[name]

        return DiagonalPair(spec.name, spec.module, positions(u), positions(v))


def _as_pair_spec(pair: PairSpec | tuple[str, str]) -> PairSpec:
    if isinstance(pair, PairSpec):
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


def find_symmetries(
    model: nn.Module,
    *,
    adapters: Sequence[Adapter] | None = None,
    extra_blocks: Iterable[BlockSpec] = (),
    diagonal_pairs: Iterable[PairSpec | tuple[str, str]] = (),
) -> ParameterSpace:
    """Split the trainable parameters of a model into GL(h) blocks, diagonal pairs and the rest.

    Modules are visited in ``named_modules()`` order; the first adapter that recognises a module
    claims it (its submodules are not visited again). Parameters with ``requires_grad=False``
    are left out of ``θ`` and listed in :attr:`ParameterSpace.excluded`; a block found by an
    adapter that touches one is not used (its trainable coordinates stay adaptive, with a
    note), whereas a user-declared block that does raises.

    Args:
        model: Any ``nn.Module``.
        adapters: Adapters to try, in order (default: the registry
            :data:`geosharp.symmetry.adapters.ADAPTERS`; pass ``[]`` to use only the declared
            blocks).
        extra_blocks: Hand-declared blocks, e.g. from
            :func:`geosharp.symmetry.declare_block`.
        diagonal_pairs: Extra diagonal pairs, as :class:`PairSpec` or ``(u_name, v_name)``.

    Returns:
        The :class:`ParameterSpace`.

    Raises:
        ValueError: If two blocks (or pairs) claim the same coordinate, two blocks share a
            name, a declared block refers to a missing or frozen parameter, or a slice does
            not fit its heads.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> mha = nn.MultiheadAttention(embed_dim=8, num_heads=2)
        >>> space = find_symmetries(mha)
        >>> [(b.name, b.heads, b.n, b.m, b.head_dim) for b in space.gl_blocks]
        [('<model>[QK]', 2, 9, 9, 4), ('<model>[VO]', 2, 9, 8, 4)]
        >>> space.adaptive_numel  # the output bias
        8
    """
    adapters = list(ADAPTERS if adapters is None else adapters)
    res = _Resolver(model)

    claims: list[tuple[str, Claim]] = []
    claimed: list[str] = []
    for path, module in model.named_modules():
        if any(path == c or c == "" or path.startswith(c + ".") for c in claimed):
            continue
        for adapter in adapters:
            claim = adapter(path, module)
            if claim is not None:
                claims.append((path, claim))
                claimed.append(path)
                break

    notes: list[tuple[str, str]] = []
    blocks: list[GLBlock] = []
    pairs: list[DiagonalPair] = []
    for path, claim in claims:
        notes.extend((path, text) for text in claim.notes)
        for spec in claim.blocks:
            try:
                blocks.append(res.block(spec))
            except _FrozenParameterError as err:
                notes.append(("", f"block {spec.name!r} not used: {err}"))
        for pspec in claim.pairs:
            try:
                pairs.append(res.pair(pspec))
            except _FrozenParameterError as err:
                notes.append(("", f"diagonal pair {pspec.name!r} not used: {err}"))
    for spec in extra_blocks:
        blocks.append(res.block(spec))
    for pair in diagonal_pairs:
        pairs.append(res.pair(_as_pair_spec(pair)))

    owner = torch.full((res.numel,), -1, dtype=torch.long)
    owners: list[str] = []
    seen_names: set[str] = set()
    for item in [*blocks, *pairs]:
        if item.name in seen_names:
            raise ValueError(f"two blocks are named {item.name!r}; block names must be unique")
        seen_names.add(item.name)
        if isinstance(item, GLBlock):
            idx = torch.cat([item.g_index.reshape(-1), item.h_index.reshape(-1)])
        else:
            idx = torch.cat([item.u_index.reshape(-1), item.v_index.reshape(-1)])
        _claim_positions(owner, owners, idx, item.name, res)
        owners.append(item.name)

    rest = torch.nonzero(owner < 0).reshape(-1)
    return ParameterSpace(
        param_names=tuple(name for name, _ in res.included),
        shapes=tuple(p.shape for _, p in res.included),
        offsets=tuple(res.offsets[name] for name, _ in res.included),
        gl_blocks=blocks,
        diagonal_pairs=pairs,
        rest_index=rest,
        excluded=dict(res.excluded),
        notes=_collapse_notes(notes),
    )


def _claim_positions(
    owner: Tensor, owners: list[str], idx: Tensor, name: str, res: _Resolver
) -> None:
    """Mark ``idx`` as owned by block number ``len(owners)``; raise on any double claim."""

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

    sorted_idx, _ = idx.sort()
    dup = sorted_idx[1:] == sorted_idx[:-1]
    if dup.any():
        pos = int(sorted_idx[1:][dup][0])
        raise ValueError(
            f"block {name!r} claims {where(pos)} twice (its G and H slices overlap); "
            "each coordinate may belong to one place only"
        )
    prev = owner[idx]
    clash = prev >= 0
    if clash.any():
        pos = int(idx[clash][0])
        other = owners[int(prev[clash][0])]
        raise ValueError(
            f"blocks {other!r} and {name!r} both claim {where(pos)}; each coordinate may "
            "belong to one block only — drop or narrow one of the declarations"
        )
    owner[idx] = len(owners)
