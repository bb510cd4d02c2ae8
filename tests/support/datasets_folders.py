"""What the datasets_folders tests of several tiers share."""

from __future__ import annotations

from pathlib import Path

from tests.support.data_files import image_of


def write_image_folder(root: Path, per_class: int = 4, size: tuple[int, int] = (12, 12), color: bool = False) -> Path:
    """Three class folders (created out of order) of PNGs and JPEGs, one inside a nested folder."""
    for label, name in enumerate(("cat", "ant", "bee")):  # sorted: ant=0, bee=1, cat=2
        folder = root / name
        (folder / "nested").mkdir(parents=True, exist_ok=True)
        for k in range(per_class):
            mode = "RGB" if color and k == 0 else "L"
            target = folder / ("nested" if k == 0 else ".") / f"{name}{k}.{'jpg' if k % 2 else 'png'}"
            image_of(40 * label + k, size, mode).save(target)
    return root


def write_png_bomb(path: Path, side: int = 20_000) -> Path:
    """A valid 1-bit PNG of side x side pixels (400 M at the default) that is about 50 KB on disk: its rows are
    zeros, which deflate packs about 1000:1."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer = zlib.compressobj(9)
    row = bytes(1 + (side + 7) // 8)  # filter byte 0, then the packed pixels
    body = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1 bit, grayscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b""))
    return path
