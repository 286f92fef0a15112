"""The model-soups population: CLIP ViT-B/32 fine-tuned on ImageNet (paper §7, 72 models).

Wortsman et al. (2022) released 72 fine-tunes of OpenAI CLIP ViT-B/32 on ImageNet as
``model_0.pt`` … ``model_71.pt`` (release ``v0.0.2`` of ``mlfoundations/model-soups``). Each
file is the ``state_dict`` of their ``ModelWrapper``: the CLIP model under ``model.`` (image
tower ``model.visual.*``; the text transformer deleted, its embeddings left in) and a linear
head ``classification_head.{weight,bias}`` (1000 × 512) applied to unit-norm image features.

:func:`load_clip_soup` accepts that layout and the common variants — a full OpenAI CLIP state
dict (``visual.*`` plus text tower), the image tower alone (``conv1.weight`` …), keys prefixed
by ``module.`` (``nn.DataParallel``), the head under ``classification_head.*`` or ``head.*`` —
and builds a :class:`CLIPClassifier` whose width, depth, patch and image size are read from the
tensor shapes (heads ``= width // 64``, as OpenAI CLIP). Anything it cannot place is an error
that lists the keys.

No data ship with geosharp: bring ImageNet (train split for the sharpness batches, val for the
test error) and preprocess it with :func:`clip_preprocess` (resize, center crop, CLIP's
mean/std; torch only, no torchvision). Labels are the standard ImageNet class indices
(``sorted`` WordNet ids, as ``ImageFolder`` numbers them).

Example:
    A tiny checkpoint in the soups layout (width 64, 2 layers, patch 8, 32-pixel images):

    >>> import torch
    >>> from geosharp.zoo import load_clip_soup
    >>> vit = OpenAIVisionTransformer(32, 8, width=64, layers=2, heads=1, output_dim=16)
    >>> sd = {f"model.visual.{k}": v for k, v in vit.state_dict().items()}
    >>> sd |= {"classification_head.weight": torch.randn(10, 16),
    ...        "classification_head.bias": torch.zeros(10)}
    >>> model = load_clip_soup(sd)
    >>> model(torch.randn(4, 3, 32, 32)).shape
    torch.Size([4, 10])
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from geosharp.zoo._openai_clip import CLIPClassifier, OpenAIVisionTransformer

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "NUM_SOUP_MODELS",
    "CLIPClassifier",
    "OpenAIVisionTransformer",
    "clip_preprocess",
    "list_population",
    "load_clip_soup",
]

#: Number of fine-tunes in the model-soups release (``model_0.pt`` … ``model_71.pt``).
NUM_SOUP_MODELS = 72
#: CLIP's per-channel normalization (RGB), as in OpenAI's ``clip.load`` preprocessing.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

_HEADS = ("classification_head", "head")
#: Keys of a CLIP model that are not the image tower (text tower and scalars); ignored.
_TEXT_TOWER = re.compile(
    r"^(positional_embedding|text_projection|logit_scale|token_embedding\.weight|"
    r"ln_final\.(weight|bias)|transformer\..*|input_resolution|context_length|vocab_size)$"
)
_SHOW = 12  # at most this many keys are listed in an error message


def _listing(keys: Any) -> str:
    keys = sorted(keys)
    shown = ", ".join(repr(k) for k in keys[:_SHOW])
    more = f", … ({len(keys) - _SHOW} more)" if len(keys) > _SHOW else ""
    return f"[{shown}{more}]"


def _read_state_dict(source: str | Path | Mapping[str, Any]) -> tuple[dict[str, Tensor], str]:
    if isinstance(source, Mapping):
        obj, where = source, "the state dict"
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(
                f"no checkpoint file at {path}; expected a model-soups state dict such as "
                "model_0.pt (see docs/paper_populations.md)"
            )
        obj = torch.load(path, map_location="cpu", weights_only=True)
        where = str(path)
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise TypeError(f"{where} holds a {type(obj).__name__}, not a state dict")
    sd: dict[str, Tensor] = {}
    for key, value in obj.items():
        if not isinstance(value, Tensor):
            continue
        while key.startswith("module."):  # nn.DataParallel / DistributedDataParallel
            key = key[len("module.") :]
        sd[key] = value
    return sd, where


def _visual_prefix(sd: Mapping[str, Tensor], where: str) -> str:
    prefixes = sorted(
        k[: -len("conv1.weight")]
        for k in sd
        if k.endswith("conv1.weight") and f"{k[: -len('conv1.weight')]}class_embedding" in sd
    )
    if len(prefixes) == 1:
        return prefixes[0]
    if not prefixes:
        hint = ""
        if any("vision_model.embeddings" in k for k in sd):
            hint = (
                " It looks like a Hugging Face CLIP checkpoint: load it with transformers' "
                "CLIPVisionModel instead (geosharp finds its attention blocks as well)."
            )
        elif any(".attnpool." in k or "layer1.0." in k for k in sd):
            hint = " It looks like a ResNet CLIP, which has no transformer image tower."
        raise ValueError(
            f"{where} holds no OpenAI-CLIP ViT image tower: expected keys ending in "
            "'conv1.weight' and 'class_embedding' (e.g. 'model.visual.conv1.weight' in "
            f"model-soups checkpoints, 'visual.conv1.weight' in OpenAI CLIP).{hint} "
            f"Keys found: {_listing(sd)}"
        )
    raise ValueError(f"{where} holds several image towers (prefixes {prefixes}); pass one")


def _head_name(sd: Mapping[str, Tensor], where: str) -> str:
    found = [h for h in _HEADS if f"{h}.weight" in sd]
    if len(found) == 1:
        return found[0]
    if found:
        raise ValueError(f"{where} holds two classification heads ({found}); keep one")
    raise ValueError(
        f"{where} holds no classification head: looked for 'classification_head.weight' "
        "(model soups) and 'head.weight'. A bare CLIP state dict has none; sharpness needs "
        f"the fine-tuned head. Keys outside the image tower: {_listing(sd)}"
    )


def _architecture(vis: Mapping[str, Tensor], where: str, heads: int | None) -> dict[str, int]:
    absent = [k for k in ("positional_embedding", "proj") if k not in vis]
    if absent:
        raise ValueError(f"{where}: the image tower has missing keys {absent}")
    width, _, patch, _ = vis["conv1.weight"].shape
    layer_ids = {
        int(m.group(1)) for k in vis if (m := re.match(r"transformer\.resblocks\.(\d+)\.", k))
    }
    layers = len(layer_ids)
    if layers == 0 or layer_ids != set(range(layers)):
        raise ValueError(
            f"{where}: the image tower's blocks are numbered {sorted(layer_ids)}; expected "
            "transformer.resblocks.0 … n-1"
        )
    tokens = vis["positional_embedding"].shape[0]
    grid = math.isqrt(tokens - 1)
    if grid * grid != tokens - 1:
        raise ValueError(
            f"{where}: positional_embedding has {tokens} rows, which is not 1 + a square "
            "number of patches"
        )
    heads = width // 64 if heads is None else heads
    if heads < 1 or width % heads:
        raise ValueError(
            f"{where}: width {width} is not divisible by heads={heads} (OpenAI CLIP uses "
            "width // 64); pass heads=… explicitly"
        )
    return {
        "image_size": patch * grid,
        "patch_size": patch,
        "width": width,
        "layers": layers,
        "heads": heads,
        "output_dim": vis["proj"].shape[1],
        "mlp_width": vis["transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
        if "transformer.resblocks.0.mlp.c_fc.weight" in vis
        else 4 * width,
    }


def _check_keys(model: torch.nn.Module, sd: Mapping[str, Tensor], where: str, what: str) -> None:
    expected = model.state_dict()
    missing = set(expected) - set(sd)
    unexpected = set(sd) - set(expected)
    wrong = {
        k: (tuple(sd[k].shape), tuple(v.shape))
        for k, v in expected.items()
        if k in sd and sd[k].shape != v.shape
    }
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing keys {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {_listing(unexpected)}")
        if wrong:
            shown = "; ".join(f"{k}: {a} vs {b}" for k, (a, b) in sorted(wrong.items())[:_SHOW])
            parts.append(f"shape mismatches (checkpoint vs model) {shown}")
        raise ValueError(
            f"{where}: the {what} does not match the OpenAI-CLIP layout: " + "; ".join(parts)
        )


def load_clip_soup(
    source: str | Path | Mapping[str, Any],
    *,
    heads: int | None = None,
    normalize: bool = True,
    dtype: torch.dtype = torch.float32,
) -> CLIPClassifier:
    """Load one model-soups fine-tune (or any OpenAI-layout CLIP ViT with a linear head).

    Args:
        source: Path of a ``model_i.pt`` (a ``torch.save``'d state dict; read with
            ``weights_only=True``), or the state dict itself.
        heads: Attention heads per block (default ``width // 64``: 12 for ViT-B/32).
        normalize: Scale image features to unit norm before the head (the soups' setting).
        dtype: Parameter dtype (OpenAI's own checkpoints are float16; soups are float32).

    Returns:
        A :class:`CLIPClassifier` in eval mode; ``model(images)`` gives logits.

    Raises:
        FileNotFoundError: If ``source`` is a path with no file.
        ValueError: If no image tower or head is found, or keys/shapes do not fit the layout
            (the message lists the missing and unexpected keys).
        TypeError: If the file holds something other than a state dict.

    Example:
        >>> model = load_clip_soup("soups/model_0.pt")  # doctest: +SKIP
        >>> model.visual.transformer.resblocks[0].attn.num_heads  # doctest: +SKIP
        12
    """
    sd, where = _read_state_dict(source)
    prefix = _visual_prefix(sd, where)
    head = _head_name(sd, where)
    parent = prefix[: -len("visual.")] if prefix.endswith("visual.") else None

    def text_tower(key: str) -> bool:
        return (
            parent is not None
            and key.startswith(parent)
            and bool(_TEXT_TOWER.match(key[len(parent) :]))
        )

    visual, head_sd, rest = {}, {}, []
    for key, value in sd.items():
        if key.startswith(f"{head}."):
            head_sd[key[len(head) + 1 :]] = value
        elif key.startswith(prefix):  # every other key when the prefix is "" (tower only)
            visual[key[len(prefix) :]] = value
        elif not text_tower(key):  # the text tower is not part of the image classifier
            rest.append(key)
    if rest:
        raise ValueError(
            f"{where}: keys outside the image tower ({prefix!r}…) and the head ({head!r}) that "
            f"are not CLIP's text tower either: {_listing(rest)}"
        )
    arch = _architecture(visual, where, heads)
    weight = head_sd.get("weight")
    if weight is None or weight.dim() != 2:
        raise ValueError(f"{where}: {head}.weight must be a matrix (classes × features)")
    model = CLIPClassifier(OpenAIVisionTransformer(**arch), weight.shape[0], normalize)
    _check_keys(model.visual, visual, where, f"image tower under {prefix!r}")
    _check_keys(model.classification_head, head_sd, where, f"head {head!r}")
    model.to(dtype)  # before loading, so that float64 weights are not rounded through float32
    model.visual.load_state_dict(visual)
    model.classification_head.load_state_dict(head_sd)
    return model.eval()


def _index(path: Path) -> int:
    return int(re.fullmatch(r"model_(\d+)\.pt", path.name).group(1))  # type: ignore[union-attr]


def list_population(folder: str | Path, *, expected: int | None = None) -> list[Path]:
    """The ``model_i.pt`` files of a folder, in numeric order (``model_2`` before ``model_10``).

    Args:
        folder: Folder holding the soups checkpoints.
        expected: If given, the number of files there must be (72 for the full release);
            a shortfall lists the missing indices.

    Returns:
        Paths of ``model_0.pt``, ``model_1.pt``, …

    Raises:
        FileNotFoundError: If the folder does not exist, holds no ``model_i.pt``, or fewer than
            ``expected``.

    Example:
        >>> list_population("soups", expected=NUM_SOUP_MODELS)[:2]  # doctest: +SKIP
        [PosixPath('soups/model_0.pt'), PosixPath('soups/model_1.pt')]
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    paths = sorted(
        (p for p in folder.iterdir() if re.fullmatch(r"model_\d+\.pt", p.name)), key=_index
    )
    if not paths:
        raise FileNotFoundError(
            f"{folder} holds no model_<i>.pt files; the model-soups release v0.0.2 provides "
            f"model_0.pt … model_{NUM_SOUP_MODELS - 1}.pt (see docs/paper_populations.md)"
        )
    if expected is not None and len(paths) != expected:
        have = {_index(p) for p in paths}
        missing = [i for i in range(expected) if i not in have]
        raise FileNotFoundError(
            f"{folder} holds {len(paths)} model_<i>.pt files, expected {expected}; missing "
            f"indices {missing[:_SHOW]}{' …' if len(missing) > _SHOW else ''}"
        )
    return paths


def _to_chw_float(image: Any) -> Tensor:
    """An image as a float ``(3, H, W)`` tensor in ``[0, 1]``."""
    if hasattr(image, "convert") and hasattr(image, "size"):  # a PIL image, without importing PIL
        import numpy as np

        image = torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)
    elif not isinstance(image, Tensor):
        import numpy as np

        arr = np.asarray(image)
        if arr.ndim != 3 or arr.shape[-1] not in (1, 3):
            raise ValueError(f"expected an (H, W, 3) array, got shape {arr.shape}")
        image = torch.from_numpy(arr.copy()).permute(2, 0, 1)
    if image.dim() != 3 or image.shape[0] not in (1, 3):
        raise ValueError(f"expected a (3, H, W) image tensor, got shape {tuple(image.shape)}")
    if image.shape[0] == 1:
        image = image.expand(3, -1, -1)
    if image.dtype == torch.uint8:
        return image.float() / 255.0
    if not image.is_floating_point():
        raise TypeError(f"image tensors must be uint8 or floating point, got {image.dtype}")
    return image.float()


def clip_preprocess(image: Any, size: int = 224) -> Tensor:
    """CLIP's evaluation transform with torch only: resize, center crop, normalize.

    Like OpenAI's ``clip.load`` preprocessing (``Resize(size, bicubic)``, ``CenterCrop(size)``,
    ``ToTensor``, ``Normalize(CLIP_MEAN, CLIP_STD)``): the shorter side is resized to ``size``
    with antialiased bicubic interpolation (close to, not bit-identical with, PIL's bicubic
    resampling that torchvision applies to PIL images), then the center ``size × size`` is cut.

    Args:
        image: A PIL image, an ``(H, W, 3)`` uint8 array, or a ``(3, H, W)`` tensor (uint8, or
            float in ``[0, 1]``).
        size: Output side (224 for ViT-B/32).

    Returns:
        A float32 ``(3, size, size)`` tensor; stack a batch with ``torch.stack``.

    Raises:
        ValueError: If the image does not have 3 (or 1) channels.
        TypeError: If a tensor image is neither uint8 nor floating point.

    Example:
        >>> import torch
        >>> img = torch.randint(0, 256, (3, 300, 400), dtype=torch.uint8)
        >>> clip_preprocess(img).shape
        torch.Size([3, 224, 224])
    """
    x = _to_chw_float(image)
    h, w = x.shape[-2:]
    # torchvision's Resize(int): shorter side -> size, longer side -> int(size · long / short)
    new_h, new_w = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
    if (new_h, new_w) != (h, w):
        x = F.interpolate(
            x[None], size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True
        )[0].clamp_(0.0, 1.0)
    top, left = round((new_h - size) / 2), round((new_w - size) / 2)
    x = x[:, top : top + size, left : left + size]
    mean = torch.tensor(CLIP_MEAN).view(3, 1, 1)
    std = torch.tensor(CLIP_STD).view(3, 1, 1)
    return (x - mean) / std
