#!/usr/bin/env python3
"""`make image`: the filter as an OCI image, written without a container daemon.

The image is the Wasm image spec's *compat* variant, which Istio (WasmPlugin
`url: oci://…`) and Envoy Gateway (EnvoyExtensionPolicy `code.type: Image`)
both pull: an OCI image manifest with one `application/vnd.oci.image.layer.v1.tar+gzip`
layer holding exactly one file, `plugin.wasm`, and the manifest annotation
`module.wasm.image/variant: compat`. It is written as an OCI image layout
(`oci-layout`, `index.json`, `blobs/sha256/…`), which `skopeo copy
oci:DIR:TAG docker://REGISTRY/…` pushes unchanged (`--preserve-digests`).

Reproducible: every byte is a function of the .wasm and the version. The tar
entry has mtime 0 (or SOURCE_DATE_EPOCH), uid/gid 0, no user names, mode
0644, ustar format; gzip has mtime 0 and no file name; JSON is written with
sorted keys and no spaces; the config has no `created` date. So the same
.wasm gives the same digest on any machine with the same zlib deflate
(zlib's level-9 output has been stable for decades).

Written by hand (stdlib only) because no daemonless image builder is on
every machine here and the format is four small JSON documents and a tar.

Usage: scripts/oci-image.py [--wasm FILE] [--out DIR] [--tag TAG]
Prints the manifest digest last (`sha256:…`); also writes DIR/digest and
DIR/plugin.wasm.sha256.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import pathlib
import re
import sys
import tarfile

LAYER_MEDIA = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG_MEDIA = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA = "application/vnd.oci.image.manifest.v1+json"

ROOT = pathlib.Path(__file__).resolve().parent.parent


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def sha256(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def layer_tar(wasm, mtime):
    """A tar holding only `plugin.wasm`, with nothing of this machine in it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("plugin.wasm")
        info.size = len(wasm)
        info.mtime = mtime
        info.mode = 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.type = tarfile.REGTYPE
        tar.addfile(info, io.BytesIO(wasm))
    return buf.getvalue()


def gzipped(data):
    buf = io.BytesIO()
    # filename="" and mtime=0: the gzip header carries neither a name nor a date.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(data)
    return buf.getvalue()


def workspace_version():
    text = (ROOT / "Cargo.toml").read_text()
    m = re.search(r'^\[workspace\.package\][^\[]*?^version\s*=\s*"([^"]+)"', text, re.M | re.S)
    return m.group(1) if m else "0.0.0"


def build(wasm, version, mtime):
    """Returns (blobs: {digest: bytes}, manifest_digest, manifest_bytes)."""
    tar = layer_tar(wasm, mtime)
    layer = gzipped(tar)
    wasm_digest = sha256(wasm)
    config = canonical({
        # What `buildah from scratch` writes; neither Istio nor Envoy Gateway
        # reads the platform of a compat image, but registries and tools
        # expect one.
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Labels": {
                "org.opencontainers.image.title": "sluice-filter",
                "org.opencontainers.image.version": version,
            }
        },
        "rootfs": {"type": "layers", "diff_ids": [sha256(tar)]},
    })
    manifest = canonical({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA,
        "config": {"mediaType": CONFIG_MEDIA, "digest": sha256(config), "size": len(config)},
        "layers": [{"mediaType": LAYER_MEDIA, "digest": sha256(layer), "size": len(layer)}],
        "annotations": {
            "module.wasm.image/variant": "compat",
            "org.opencontainers.image.title": "sluice-filter",
            "org.opencontainers.image.version": version,
            # Lets anyone holding only the image check it against a built .wasm.
            "io.sluice.plugin.wasm.sha256": wasm_digest.split(":", 1)[1],
        },
    })
    blobs = {sha256(layer): layer, sha256(config): config, sha256(manifest): manifest}
    return blobs, sha256(manifest), manifest


def write_layout(out, blobs, manifest_digest, manifest, tag):
    """An OCI image layout in `out`, replacing what was there."""
    out.mkdir(parents=True, exist_ok=True)
    blob_dir = out / "blobs" / "sha256"
    if blob_dir.exists():
        for old in blob_dir.iterdir():
            old.unlink()
    blob_dir.mkdir(parents=True, exist_ok=True)
    for digest, data in blobs.items():
        (blob_dir / digest.split(":", 1)[1]).write_bytes(data)
    (out / "oci-layout").write_bytes(canonical({"imageLayoutVersion": "1.0.0"}))
    index = canonical({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": MANIFEST_MEDIA,
            "digest": manifest_digest,
            "size": len(manifest),
            "annotations": {"org.opencontainers.image.ref.name": tag},
        }],
    })
    (out / "index.json").write_bytes(index)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wasm", default=str(ROOT / "target/wasm32-wasip1/release/sluice_filter.wasm"))
    ap.add_argument("--out", default=str(ROOT / "target/image/sluice-filter"))
    ap.add_argument("--tag", default=None, help="the layout's ref name (default: the version)")
    args = ap.parse_args()

    wasm_path = pathlib.Path(args.wasm)
    try:
        wasm = wasm_path.read_bytes()
    except OSError as e:
        sys.exit(f"oci-image: cannot read the filter ({e}); run `make build` first")
    if wasm[:4] != b"\0asm":
        sys.exit(f"oci-image: {wasm_path} is not a WebAssembly module")
    version = workspace_version()
    mtime = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    blobs, digest, manifest = build(wasm, version, mtime)
    out = pathlib.Path(args.out)
    write_layout(out, blobs, digest, manifest, args.tag or version)
    wasm_sha = hashlib.sha256(wasm).hexdigest()
    (out / "digest").write_text(digest + "\n")
    (out / "plugin.wasm.sha256").write_text(wasm_sha + "\n")
    print(f"image:       {out} (OCI layout, ref {args.tag or version})")
    print(f"plugin.wasm: sha256 {wasm_sha} ({len(wasm)} bytes)")
    print(f"push:        skopeo copy --preserve-digests oci:{out}:{args.tag or version} docker://REGISTRY/sluice-filter:{args.tag or version}")
    print(digest)


if __name__ == "__main__":
    main()
