"""The hubs ttsrl fetches from, through their own clients: Hugging Face (``huggingface_hub``, the
default; ``HF_ENDPOINT`` names a mirror, e.g. https://hf-mirror.com) and, only where the
``modelscope`` package is installed, ModelScope (``MODELSCOPE_DOMAIN``) for the model folders.

:func:`reachable` asks once, with a short timeout, before anything is fetched, so a node without a
network learns it in seconds rather than by a timeout per file. ``HF_HUB_OFFLINE=1`` answers
without asking. The clients are imported only when something is fetched: the checks and the
offline message need the standard library alone (run.sh may run this before the venv exists).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from urllib.parse import urlsplit

HF_DEFAULT = "https://huggingface.co"
MODELSCOPE_DEFAULT = "https://www.modelscope.cn"
PROBE_TIMEOUT_S = 4.0


@dataclass(frozen=True)
class HubRepo:
    """Files of one hub repository: ``patterns`` (fnmatch, ``*`` crosses folders) select them."""

    repo_id: str
    repo_type: str = "model"  # "model" or "dataset"
    revision: str = "main"
    patterns: tuple[str, ...] = ("*",)
    modelscope_id: str = ""

    def wants(self, path: str) -> bool:
        return any(fnmatch(path, p) for p in self.patterns)

    def describe(self) -> str:
        kind = "dataset " if self.repo_type == "dataset" else ""
        ms = f" (ModelScope: {self.modelscope_id})" if self.modelscope_id else ""
        return f"Hugging Face {kind}{self.repo_id} @ {self.revision}{ms}"

    def cli(self, local_dir: str | None = None) -> str:
        """The huggingface_hub CLI line that downloads these files elsewhere."""
        words = ["hf download", self.repo_id]
        if self.repo_type == "dataset":
            words.append("--repo-type dataset")
        if self.revision != "main":
            words.append(f"--revision {self.revision}")
        if self.patterns != ("*",):
            words.append("--include " + " ".join(f"'{p}'" for p in self.patterns))
        if local_dir:
            words.append(f"--local-dir {local_dir}")
        return " ".join(words)


def hf_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", HF_DEFAULT).rstrip("/")


def hf_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def modelscope_installed() -> bool:
    try:
        import modelscope  # noqa: F401
    except ImportError:
        return False
    return True


def reachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when ``url``'s host answers a TCP connection within ``timeout`` seconds, else why not.
    Name resolution included: the probe runs in a thread and is abandoned at the deadline."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    if not host:
        return f"{url}: no host"
    proxy = os.environ.get("HTTPS_PROXY" if parts.scheme == "https" else "HTTP_PROXY") \
        or os.environ.get("https_proxy" if parts.scheme == "https" else "http_proxy")
    if proxy and urlsplit(proxy).hostname:  # through a proxy: the proxy is what must answer
        p = urlsplit(proxy)
        host, port = p.hostname, p.port or 80
    result: list[str | None] = []

    def probe():
        import socket

        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(None)
        except OSError as e:
            result.append(f"{host}:{port}: {e.strerror or e}")

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 1)
    return result[0] if result else f"{host}:{port}: no answer within {timeout:.0f} s"


def hf_files(repo: HubRepo) -> tuple[str, dict[str, dict]]:
    """(commit, {path: {"size", "sha256" (LFS files only)}}) of the repository's wanted files:
    one ``repo_info`` call (Hugging Face's /api/{models,datasets}/REPO/revision/REV)."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=hf_endpoint()).repo_info(repo.repo_id, repo_type=repo.repo_type, revision=repo.revision,
                                                   files_metadata=True)
    files = {}
    for s in info.siblings or ():
        if repo.wants(s.rfilename):
            lfs = getattr(s, "lfs", None)
            files[s.rfilename] = {"size": s.size, "sha256": getattr(lfs, "sha256", None) if lfs else None}
    return info.sha, files


def hf_download(repo: HubRepo, commit: str, path: str, local_dir: Path | None) -> Path:
    """One file through ``hf_hub_download`` (resumable: an interrupted transfer continues from its
    ``.incomplete`` file; a file appears under its name only when complete). ``local_dir``: into
    that folder; None: into the Hugging Face cache (``HF_HOME``), shared with other tools."""
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo.repo_id, path, repo_type=repo.repo_type, revision=commit,
                                local_dir=str(local_dir) if local_dir else None, endpoint=hf_endpoint()))


def modelscope_download(repo: HubRepo, local_dir: Path) -> str:
    """The wanted files of ``repo.modelscope_id`` into ``local_dir`` with ModelScope's own client
    (resumable, ``MODELSCOPE_DOMAIN`` aware); returns the revision asked for. Used only when the
    Hugging Face endpoint cannot be reached and ``modelscope`` is installed (not exercised by the
    tests: the package is not in ttsrl's venv)."""
    from modelscope import snapshot_download

    snapshot_download(repo.modelscope_id, revision=None if repo.revision == "main" else repo.revision,
                      local_dir=str(local_dir), allow_patterns=list(repo.patterns))
    return repo.revision
