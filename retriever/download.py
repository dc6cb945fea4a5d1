"""Download the retrieval files Search-R1 publishes, reassemble them and adopt them as an index directory.

    python -m retriever.download --index wiki18-e5-flat --save_path /data/searchr1 \\
        [--index_dir /data/searchr1/index_wiki18-e5-flat] [--device cuda]

Artefacts (Hugging Face dataset repositories named in Search-R1's ``README.md:106-111``, ``scripts/download.py:10-25``
and ``docs/retriever.md:5,86-90``):

=====================  ======================================  =====================================================
name                   repository                              files -> result
=====================  ======================================  =====================================================
``wiki18-corpus``      ``PeterJinGo/wiki-18-corpus``           ``wiki-18.jsonl.gz`` -> ``wiki-18.jsonl`` (gunzipped)
``wiki18-e5-flat``     ``PeterJinGo/wiki-18-e5-index``         ``part_aa``, ``part_ab`` -> ``e5_Flat.index``
``wiki18-e5-hnsw64``   ``PeterJinGo/wiki-18-e5-index-HNSW64``  ``part_*`` -> ``e5_HNSW64.index``
=====================  ======================================  =====================================================

Each file is fetched with ``huggingface_hub.hf_hub_download`` (skipped when already there with the repository's
size), its size checked against the repository's listing, the ``part_*`` files concatenated in name order (the
``cat part_* > e5_Flat.index`` of Search-R1's README) and the total checked, the ``.gz`` corpus gunzipped (gzip's own
CRC and length check), then the index is adopted (``retriever.adopt``: verified against the corpus and
``e5-base-v2`` before anything serves it). Disk: while the parts are concatenated, they and the assembled index lie
side by side (about twice the index: 2 x 60 GiB for the Flat one); the command checks the free space first and
deletes the fetched files once the result is checked (``--keep_parts`` keeps them). ``--from_dir DIR`` reads the
files from a local copy laid out like the repositories (``DIR/PeterJinGo/wiki-18-e5-index/part_aa`` ...) instead of
the Hub. Offline, the command fails in one line saying what to place where.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass

logger = logging.getLogger("retriever.download")


class DownloadError(RuntimeError):
    """A file could not be fetched, or its size does not match the repository's; one line."""


@dataclass(frozen=True)
class Artefact:
    """One published file set: ``repo`` (a Hugging Face dataset), ``pattern`` (its files, fnmatch), ``output``
    (what they become: the parts concatenated, or the one file, gunzipped when ``gunzip``); for an index, the
    ``encoder`` that built it and the ``corpus`` artefact it indexes."""

    repo: str
    pattern: str
    output: str
    gunzip: bool = False
    encoder: str | None = None
    corpus: str | None = None


ARTEFACTS: dict[str, Artefact] = {
    "wiki18-corpus": Artefact("PeterJinGo/wiki-18-corpus", "wiki-18.jsonl.gz", "wiki-18.jsonl", gunzip=True),
    "wiki18-e5-flat": Artefact("PeterJinGo/wiki-18-e5-index", "part_*", "e5_Flat.index", encoder="e5-base-v2",
                               corpus="wiki18-corpus"),
    "wiki18-e5-hnsw64": Artefact("PeterJinGo/wiki-18-e5-index-HNSW64", "part_*", "e5_HNSW64.index",
                                 encoder="e5-base-v2", corpus="wiki18-corpus"),
}


class HubSource:
    """Files of a Hugging Face dataset repository (``huggingface_hub``)."""

    def list(self, repo: str) -> dict[str, int]:
        """{file name: size in bytes} of the repository's top-level files."""
        from huggingface_hub import HfApi

        try:
            return {f.path: int(f.size) for f in HfApi().list_repo_tree(repo, repo_type="dataset")
                    if getattr(f, "size", None) is not None}
        except Exception as e:  # offline mode, no network, no such repository: one line for the user
            raise DownloadError(_offline_message(repo, e)) from e

    def fetch(self, repo: str, name: str, dest_dir: str) -> str:
        from huggingface_hub import hf_hub_download

        try:
            return hf_hub_download(repo_id=repo, filename=name, repo_type="dataset", local_dir=dest_dir)
        except Exception as e:
            raise DownloadError(_offline_message(repo, e)) from e


class LocalSource:
    """The same files from a local folder laid out like the repositories: ``root/OWNER/NAME/FILE``."""

    def __init__(self, root: str):
        self.root = root

    def list(self, repo: str) -> dict[str, int]:
        d = os.path.join(self.root, repo)
        if not os.path.isdir(d):
            raise DownloadError(f"--from_dir: no folder {d} (expected the files of {repo} there)")
        return {f: os.path.getsize(os.path.join(d, f)) for f in sorted(os.listdir(d))
                if os.path.isfile(os.path.join(d, f))}

    def fetch(self, repo: str, name: str, dest_dir: str) -> str:
        dest = os.path.join(dest_dir, name)
        shutil.copyfile(os.path.join(self.root, repo, name), dest + ".tmp")
        os.replace(dest + ".tmp", dest)
        return dest


def _offline_message(repo: str, e: Exception) -> str:
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    reason = reason if len(reason) <= 160 else reason[:157] + "..."
    off = " (HF_HUB_OFFLINE=1 is set)" if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") else ""
    return (f"cannot reach the Hugging Face Hub for {repo}{off}: {type(e).__name__}: {reason}; download its files "
            f"elsewhere and rerun with --from_dir DIR holding DIR/{repo}/<files>")


def disk_needed(art: Artefact, listing: dict[str, int], files: list[str], save_path: str,
                keep_parts: bool) -> tuple[int, str]:
    """(bytes that must be free in ``save_path`` before fetching, one line saying why): the files still to fetch, plus
    for parts the assembled file written beside them (parts and result side by side: about twice the index while
    assembling; the parts are deleted afterwards unless ``keep_parts``). A ``.gz`` file's uncompressed size is not
    listed, so only the download is counted for it."""
    have = sum(listing[f] for f in files if os.path.isfile(os.path.join(save_path, f))
               and os.path.getsize(os.path.join(save_path, f)) == listing[f])
    total = sum(listing[f] for f in files)
    if art.gunzip:
        fate = "kept: --keep_parts" if keep_parts else "deleted afterwards"
        return total - have, (f"{art.output}: {total / 1e9:.1f} GB to fetch, then gunzipped beside it (the .gz is "
                              f"{fate})")
    after = "kept (--keep_parts): twice the index for good" if keep_parts else "deleted once the result is checked"
    return total - have + total, (f"{art.output}: {len(files)} part(s) of {total / 1e9:.1f} GB and the assembled "
                                  f"file of the same size side by side ({2 * total / 1e9:.1f} GB); the parts are "
                                  f"{after}")


def fetch_artefact(name_or_artefact, save_path: str, source=None, keep_parts: bool = False) -> str:
    """Fetch, check and assemble one artefact into ``save_path``; returns the path of its ``output`` file.

    An ``output`` already in ``save_path`` is reused without contacting the source. Otherwise the free disk is checked
    (:func:`disk_needed`), every matching file is fetched (kept when already present with the listed size), each size
    checked against the listing, parts concatenated in name order (total checked), a ``.gz`` file gunzipped (gzip
    checks CRC and length); the fetched files are then deleted unless ``keep_parts``.

    Raises:
        DownloadError: unknown name, no matching file, too little free disk, a size mismatch, a corrupt gzip, or
            the source unreachable.
    """
    art = ARTEFACTS.get(name_or_artefact) if isinstance(name_or_artefact, str) else name_or_artefact
    if art is None:
        raise DownloadError(f"unknown artefact {name_or_artefact!r}; known: {', '.join(sorted(ARTEFACTS))}")
    os.makedirs(save_path, exist_ok=True)
    out = os.path.join(save_path, art.output)
    if os.path.isfile(out):
        logger.info("%s already there: %s", art.output, out)
        return out
    source = source or HubSource()
    listing = source.list(art.repo)
    files = sorted(f for f in listing if fnmatch.fnmatch(f, art.pattern))
    if not files:
        raise DownloadError(f"{art.repo} has no file matching {art.pattern!r} (it holds: {', '.join(sorted(listing))})")
    needed, why = disk_needed(art, listing, files, save_path, keep_parts)
    free = shutil.disk_usage(save_path).free
    logger.info("disk: %s; %.1f GB needed free in %s, %.1f GB free", why, needed / 1e9, save_path, free / 1e9)
    if free < needed:
        raise DownloadError(f"{save_path}: {free / 1e9:.1f} GB free, {needed / 1e9:.1f} GB needed ({why}): free "
                            f"space or choose another --save_path")
    local = []
    for f in files:
        path = os.path.join(save_path, f)
        if not (os.path.isfile(path) and os.path.getsize(path) == listing[f]):
            logger.info("fetching %s/%s (%.1f GB)", art.repo, f, listing[f] / 1e9)
            path = source.fetch(art.repo, f, save_path)
        size = os.path.getsize(path)
        if size != listing[f]:
            raise DownloadError(f"{path}: {size:,} bytes, {art.repo} lists {listing[f]:,} ({listing[f] - size:,} "
                                "missing): delete it and rerun")
        local.append(path)
    tmp = out + ".tmp"
    if art.gunzip:
        if len(local) != 1:
            raise DownloadError(f"{art.repo}: expected one .gz file, found {len(local)}")
        try:
            with gzip.open(local[0], "rb") as fi, open(tmp, "wb") as fo:
                shutil.copyfileobj(fi, fo, 16 << 20)
        except (OSError, EOFError) as e:  # BadGzipFile is an OSError; a truncated stream is an EOFError
            os.remove(tmp)
            raise DownloadError(f"{local[0]}: not a complete gzip file ({e}): delete it and rerun") from e
    else:
        with open(tmp, "wb") as fo:
            for p in local:
                with open(p, "rb") as fi:
                    shutil.copyfileobj(fi, fo, 16 << 20)
        total, want = os.path.getsize(tmp), sum(listing[f] for f in files)
        if total != want:
            os.remove(tmp)
            raise DownloadError(f"{out}: {total:,} bytes after concatenating {len(files)} parts, expected {want:,}")
    os.replace(tmp, out)
    logger.info("%s: %s (%d file(s) from %s)", art.output, out, len(local), art.repo)
    if not keep_parts:
        for p in local:
            os.remove(p)
        logger.info("deleted the %d fetched file(s) (--keep_parts keeps them)", len(local))
    return out


def download_and_adopt(index: str, save_path: str, index_dir: str | None = None, source=None,
                       artefacts: dict | None = None, keep_parts: bool = False, **adopt_kwargs) -> dict:
    """Fetch the index artefact ``index`` and its corpus into ``save_path``, then adopt them into ``index_dir``
    (default ``save_path/index_<name>``); returns the manifest. ``adopt_kwargs`` go to ``retriever.adopt.adopt_index``
    (``device``, ``verify_sample`` ...).

    Raises:
        DownloadError: see :func:`fetch_artefact`; ``index`` is not an index artefact.
        retriever.adopt.AdoptionError: the files do not pass verification.
    """
    from .adopt import adopt_index

    table = artefacts or ARTEFACTS
    art = table.get(index)
    if art is None or art.encoder is None:
        raise DownloadError(f"{index!r} is not an index artefact; choose from "
                            f"{', '.join(sorted(k for k, v in table.items() if v.encoder))}")
    corpus = fetch_artefact(table[art.corpus], save_path, source, keep_parts)
    faiss_file = fetch_artefact(art, save_path, source, keep_parts)
    return adopt_index(corpus, index_dir or os.path.join(save_path, f"index_{index}"), faiss_file, art.encoder,
                       **adopt_kwargs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m retriever.download", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", default="wiki18-e5-flat",
                   choices=sorted(k for k, v in ARTEFACTS.items() if v.encoder), help="index to fetch and adopt")
    p.add_argument("--save_path", required=True, help="where the downloaded and reassembled files go")
    p.add_argument("--index_dir", default=None, help="index directory to write (default SAVE_PATH/index_<name>)")
    p.add_argument("--from_dir", default=None, help="a local copy laid out as DIR/OWNER/REPO/FILE instead of the Hub")
    p.add_argument("--no_adopt", action="store_true", help="only fetch and reassemble")
    p.add_argument("--device", default=None, help="encoder device for the verification sample (cpu, cuda)")
    p.add_argument("--verify_sample", type=int, default=64)
    p.add_argument("--overwrite", action="store_true", help="replace an index already in --index_dir")
    p.add_argument("--keep_parts", action="store_true",
                   help="keep the fetched part_* / .gz files after assembling (by default they are deleted: the Flat "
                        "index is 60 GiB, and parts beside it double the disk)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    source = LocalSource(a.from_dir) if a.from_dir else None
    from .index import RetrieverIndexError

    try:
        if a.no_adopt:
            art = ARTEFACTS[a.index]
            for path in (fetch_artefact(art.corpus, a.save_path, source, a.keep_parts),
                         fetch_artefact(art, a.save_path, source, a.keep_parts)):
                print(path)
            return 0
        manifest = download_and_adopt(a.index, a.save_path, a.index_dir, source=source, device=a.device,
                                      verify_sample=a.verify_sample, overwrite=a.overwrite, keep_parts=a.keep_parts)
    except (DownloadError, RetrieverIndexError, ValueError, OSError) as e:
        print(f"download: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"index_dir": a.index_dir or os.path.join(a.save_path, f"index_{a.index}"),
                      "count": manifest["count"], "adopted_from": manifest["adopted"]["faiss_index"],
                      "verification": manifest["adopted"]["verification"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
