"""The model-soups loader, on tiny checkpoints in the OpenAI-CLIP / model-soups layout.

The state dicts are built here from the layout's key names (not from geosharp's module), and
the loaded model is compared with a forward pass written out with plain tensor operations.
"""

import math
import re

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import geosharp as gs
from geosharp.zoo import (
    CLIP_MEAN,
    CLIP_STD,
    NUM_SOUP_MODELS,
    clip_preprocess,
    list_clip_soups,
    load_clip_soup,
)

WIDTH, LAYERS, PATCH, IMAGE, OUT, CLASSES = 64, 2, 8, 32, 32, 10
GRID = IMAGE // PATCH
DT = torch.float64


def visual_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """OpenAI CLIP ``visual.*`` keys (without the prefix), random values."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return scale * torch.randn(*shape, generator=g, dtype=DT)

    sd = {
        "class_embedding": r(WIDTH),
        "positional_embedding": r(GRID * GRID + 1, WIDTH),
        "proj": r(WIDTH, OUT),
        "conv1.weight": r(WIDTH, 3, PATCH, PATCH, scale=0.05),
        "ln_pre.weight": 1 + r(WIDTH),
        "ln_pre.bias": r(WIDTH),
        "ln_post.weight": 1 + r(WIDTH),
        "ln_post.bias": r(WIDTH),
    }
    for i in range(LAYERS):
        p = f"transformer.resblocks.{i}."
        sd |= {
            p + "attn.in_proj_weight": r(3 * WIDTH, WIDTH),
            p + "attn.in_proj_bias": r(3 * WIDTH),
            p + "attn.out_proj.weight": r(WIDTH, WIDTH),
            p + "attn.out_proj.bias": r(WIDTH),
            p + "ln_1.weight": 1 + r(WIDTH),
            p + "ln_1.bias": r(WIDTH),
            p + "mlp.c_fc.weight": r(4 * WIDTH, WIDTH),
            p + "mlp.c_fc.bias": r(4 * WIDTH),
            p + "mlp.c_proj.weight": r(WIDTH, 4 * WIDTH),
            p + "mlp.c_proj.bias": r(WIDTH),
            p + "ln_2.weight": 1 + r(WIDTH),
            p + "ln_2.bias": r(WIDTH),
        }
    return sd


def text_tower(seed: int) -> dict[str, torch.Tensor]:
    """What model-soups' ModelWrapper leaves of CLIP's text side (its transformer deleted)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "positional_embedding": torch.randn(7, 16, generator=g),
        "text_projection": torch.randn(16, OUT, generator=g),
        "logit_scale": torch.tensor(4.6),
        "token_embedding.weight": torch.randn(50, 16, generator=g),
        "ln_final.weight": torch.ones(16),
        "ln_final.bias": torch.zeros(16),
    }


def head(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(CLASSES, OUT, generator=g, dtype=DT), "bias": torch.zeros(10)}


def soups_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """The layout of model_i.pt: ModelWrapper.state_dict() (``model.*`` + classification_head)."""
    sd = {f"model.visual.{k}": v for k, v in visual_state_dict(seed).items()}
    sd |= {f"model.{k}": v for k, v in text_tower(seed).items()}
    sd |= {f"classification_head.{k}": v for k, v in head(seed).items()}
    return sd


def reference_logits(vis, hd, x, heads, normalize=True):
    """CLIP's image tower written out with tensor operations (independent of geosharp.zoo)."""
    x = F.conv2d(x, vis["conv1.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    cls = vis["class_embedding"].expand(x.shape[0], 1, WIDTH)
    x = torch.cat([cls, x], 1) + vis["positional_embedding"]

    def ln(z, name):
        return F.layer_norm(z, (WIDTH,), vis[name + ".weight"], vis[name + ".bias"], 1e-5)

    x = ln(x, "ln_pre")
    h = WIDTH // heads
    for i in range(LAYERS):
        p = f"transformer.resblocks.{i}."
        y = ln(x, p + "ln_1")
        qkv = y @ vis[p + "attn.in_proj_weight"].T + vis[p + "attn.in_proj_bias"]
        q, k, v = (t.unflatten(-1, (heads, h)).transpose(1, 2) for t in qkv.chunk(3, -1))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(h), -1)
        o = (att @ v).transpose(1, 2).flatten(2)
        x = x + o @ vis[p + "attn.out_proj.weight"].T + vis[p + "attn.out_proj.bias"]
        y = ln(x, p + "ln_2")
        y = y @ vis[p + "mlp.c_fc.weight"].T + vis[p + "mlp.c_fc.bias"]
        y = y * torch.sigmoid(1.702 * y)
        x = x + y @ vis[p + "mlp.c_proj.weight"].T + vis[p + "mlp.c_proj.bias"]
    f = ln(x[:, 0], "ln_post") @ vis["proj"]
    if normalize:
        f = f / f.norm(dim=-1, keepdim=True)
    return f @ hd["weight"].T.to(f) + hd["bias"].to(f)


@pytest.fixture
def images():
    return torch.randn(3, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(9), dtype=DT)


@pytest.fixture
def soups_folder(tmp_path):
    for i in (0, 1, 10):
        torch.save(soups_state_dict(i), tmp_path / f"model_{i}.pt")
    (tmp_path / "notes.txt").write_text("not a model")
    return tmp_path


def test_list_population(soups_folder):
    paths = list_clip_soups(soups_folder)
    assert [p.name for p in paths] == ["model_0.pt", "model_1.pt", "model_10.pt"]
    with pytest.raises(FileNotFoundError, match=r"holds 3 .* expected 72; missing indices \[2, "):
        list_clip_soups(soups_folder, expected=NUM_SOUP_MODELS)
    with pytest.raises(FileNotFoundError, match=r"model_0\.pt … model_71\.pt"):
        list_clip_soups(soups_folder / "..")  # a folder with none
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        list_clip_soups(soups_folder / "missing")


def test_load_soups_checkpoint_matches_reference(soups_folder, images):
    outputs = []
    for i, path in zip((0, 1), list_clip_soups(soups_folder), strict=False):
        model = load_clip_soup(path, dtype=DT)
        assert not model.training
        assert model.visual.transformer.resblocks[0].attn.num_heads == WIDTH // 64 == 1
        with torch.no_grad():
            outputs.append(model(images))
        want = reference_logits(visual_state_dict(i), head(i), images, heads=1)
        # same float64 operations in a different order: agreement to rounding (~1e-15)
        torch.testing.assert_close(outputs[-1], want, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(*outputs)


def test_symmetries_and_invariance(soups_folder, images):
    model = load_clip_soup(soups_folder / "model_0.pt", dtype=DT)
    space = gs.find_symmetries(model)
    got = [(b.name, b.kind, b.heads, b.head_dim, b.n, b.m) for b in space.gl_blocks]
    want = []
    for i in range(LAYERS):
        name = f"visual.transformer.resblocks.{i}.attn"
        # G = [W; b]ᵀ rows per head (d + 1); H_QK = W_kᵀ (b_k is a translation block);
        # H_VO = W_o[:, r_i] has no bias row
        want += [(f"{name}[QK]", "QK", 1, 64, WIDTH + 1, WIDTH)]
        want += [(f"{name}[VO]", "VO", 1, 64, WIDTH + 1, WIDTH)]
    assert got == want
    report = gs.check_invariance(model, images, space=space)
    assert report.passed, str(report)


def test_heads_override(soups_folder, images):
    model = load_clip_soup(soups_folder / "model_0.pt", heads=4, dtype=DT)
    space = gs.find_symmetries(model)
    assert {(b.heads, b.head_dim) for b in space.gl_blocks} == {(4, 16)}
    with torch.no_grad():
        got = model(images)
    torch.testing.assert_close(
        got, reference_logits(visual_state_dict(0), head(0), images, 4), rtol=1e-10, atol=1e-12
    )
    assert gs.check_invariance(model, images, space=space).passed
    with pytest.raises(ValueError, match="not divisible by heads=5"):
        load_clip_soup(soups_folder / "model_0.pt", heads=5)


def test_layout_variants_give_the_same_model(images):
    vis, hd = visual_state_dict(3), head(3)
    want = reference_logits(vis, hd, images, heads=1)
    text_transformer = {  # a full OpenAI CLIP state dict also has the text transformer
        "transformer.resblocks.0.attn.in_proj_weight": torch.randn(48, 16),
        "transformer.resblocks.0.ln_1.weight": torch.ones(16),
        "input_resolution": torch.tensor(IMAGE),
    }
    variants = {
        "openai full": {f"visual.{k}": v for k, v in vis.items()}
        | text_tower(3)
        | text_transformer
        | {f"head.{k}": v for k, v in hd.items()},
        "image tower only": vis | {f"classification_head.{k}": v for k, v in hd.items()},
        "DataParallel": {f"module.{k}": v for k, v in soups_state_dict(3).items()},
        "wrapped": {"state_dict": soups_state_dict(3), "epoch": 3},
    }
    for name, sd in variants.items():
        with torch.no_grad():
            got = load_clip_soup(sd, dtype=DT)(images)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)
    unnormalized = load_clip_soup(soups_state_dict(3), normalize=False, dtype=DT)
    torch.testing.assert_close(
        unnormalized(images).detach(),
        reference_logits(vis, hd, images, 1, normalize=False),
        rtol=1e-10,
        atol=1e-12,
    )


def test_float32_default_and_image_size_check(soups_folder):
    model = load_clip_soup(soups_folder / "model_0.pt")
    assert model.visual.conv1.weight.dtype == torch.float32
    assert model(torch.randn(2, 3, IMAGE, IMAGE)).shape == (2, CLASSES)
    with pytest.raises(ValueError, match=r"expected images of shape \(batch, 3, 32, 32\)"):
        model(torch.randn(2, 3, 224, 224))


def test_sharpness_runs_through_fused_attention(soups_folder, images):
    # the estimator differentiates through nn.MultiheadAttention under functional_call
    model = load_clip_soup(soups_folder / "model_0.pt", dtype=DT)
    labels = torch.tensor([0, 3, 7])
    res = gs.sharpness(
        model, F.cross_entropy, [(images, labels)], rho=0.05, steps=2, progress=False
    )
    assert math.isfinite(res.value) and res.value >= 0.0
    with torch.no_grad():
        assert torch.equal(
            model(images), load_clip_soup(soups_folder / "model_0.pt", dtype=DT)(images)
        )


def _message(err) -> str:
    return str(err.value)


def test_errors_list_missing_and_unexpected_keys(tmp_path):
    sd = soups_state_dict(0)
    del sd["model.visual.ln_post.weight"]
    with pytest.raises(ValueError, match=r"missing keys \['ln_post.weight'\]"):
        load_clip_soup(sd)
    sd = soups_state_dict(0)
    del sd["model.visual.proj"]
    with pytest.raises(ValueError, match=r"missing keys \['proj'\]"):
        load_clip_soup(sd)
    sd = soups_state_dict(0) | {"model.visual.transformer.resblocks.0.attn.extra": torch.ones(1)}
    with pytest.raises(ValueError, match=r"unexpected keys \['transformer.resblocks.0.attn.extra'"):
        load_clip_soup(sd)
    sd = soups_state_dict(0) | {"optimizer.step": torch.ones(1)}
    with pytest.raises(ValueError, match=r"not CLIP's text tower either: \['optimizer.step'\]"):
        load_clip_soup(sd)
    sd = soups_state_dict(0)
    sd["model.visual.transformer.resblocks.1.mlp.c_proj.bias"] = torch.zeros(WIDTH + 1)
    with pytest.raises(ValueError, match=r"shape mismatches .*c_proj.bias: \(65,\) vs \(64,\)"):
        load_clip_soup(sd)
    sd = {k: v for k, v in soups_state_dict(0).items() if not k.startswith("classification_head")}
    with pytest.raises(ValueError, match="no classification head"):
        load_clip_soup(sd)
    with pytest.raises(ValueError, match="two classification heads"):
        load_clip_soup(soups_state_dict(0) | {f"head.{k}": v for k, v in head(0).items()})
    with pytest.raises(ValueError, match="Hugging Face CLIP checkpoint"):
        load_clip_soup({"vision_model.embeddings.patch_embedding.weight": torch.ones(1)})
    with pytest.raises(ValueError, match="holds no OpenAI-CLIP ViT image tower"):
        load_clip_soup({"fc.weight": torch.ones(2, 2)})
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        load_clip_soup(tmp_path / "model_5.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(TypeError, match="holds a list, not a state dict"):
        load_clip_soup(tmp_path / "list.pt")


# -- preprocessing --------------------------------------------------------------------------------
def _normalized(x: torch.Tensor) -> torch.Tensor:
    mean, std = torch.tensor(CLIP_MEAN).view(3, 1, 1), torch.tensor(CLIP_STD).view(3, 1, 1)
    return (x - mean) / std


def test_preprocess_center_crop_without_resize():
    # shorter side already 224: only the crop (columns 38 … 261) and the normalization act
    img = torch.randint(0, 256, (3, 224, 300), dtype=torch.uint8, generator=torch.Generator())
    got = clip_preprocess(img)
    torch.testing.assert_close(got, _normalized(img[:, :, 38:262].float() / 255))
    # the same image as an (H, W, 3) array and as a PIL image
    arr = img.permute(1, 2, 0).numpy()
    torch.testing.assert_close(clip_preprocess(arr), got)
    pil = pytest.importorskip("PIL.Image")
    torch.testing.assert_close(clip_preprocess(pil.fromarray(arr)), got)


def test_preprocess_resize():
    # a constant image stays constant through the resize: the output is the normalized colour
    img = torch.ones(3, 500, 375) * torch.tensor([0.2, 0.5, 0.9]).view(3, 1, 1)
    got = clip_preprocess(img, size=64)
    assert got.shape == (3, 64, 64)
    torch.testing.assert_close(got, _normalized(img[:, :64, :64]), atol=1e-5, rtol=0)
    # grayscale is broadcast to RGB; a smooth ramp keeps its orientation and range
    ramp = torch.linspace(0, 1, 400).view(1, 1, 400).expand(1, 300, 400)
    out = clip_preprocess(ramp, size=32)
    assert out.shape == (3, 32, 32)
    assert (out[0, :, 1:] > out[0, :, :-1]).all()
    with pytest.raises(ValueError, match=r"expected a \(3, H, W\) image tensor"):
        clip_preprocess(torch.zeros(4, 8, 8))
    with pytest.raises(TypeError, match="uint8 or floating point"):
        clip_preprocess(torch.zeros(3, 8, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"expected an \(H, W, 3\) array"):
        clip_preprocess(np.zeros((8, 8)))


def test_keys_regex_sanity():
    # the text-tower keys left by ModelWrapper are exactly what the loader skips
    from geosharp.zoo.clip_soups import _TEXT_TOWER

    assert all(_TEXT_TOWER.match(k) for k in text_tower(0))
    assert not any(_TEXT_TOWER.match(k) for k in ("visual.proj", "classification_head.weight"))
    assert re.fullmatch(r"model_\d+\.pt", "model_71.pt")
