"""Models by name: ``org/repo`` (a safetensors checkpoint), ``org/repo:FILE.gguf`` or ``org/repo:QUANT`` (a GGUF),
fetched into and read from huggingface_hub's cache.

huggingface_hub reads its own settings: ``HF_HUB_OFFLINE`` (the cache alone,
no network), the token (``HF_TOKEN`` or the saved ``hf auth login``) and the
cache's place (``HF_HOME`` / ``HF_HUB_CACHE``); nothing here reads the
environment.  A local path always wins over a name it could also be.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from kestrel_stream.errors import LoadError

# org/repo with an optional :FILE.gguf or :QUANT; names as the Hub allows them (letters, digits, - _ .)
HUB_NAME = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<file>[^:]+))?")
# what a safetensors checkpoint needs besides its weights: config, tokenizer, chat template (top level only)
CHECKPOINT_SUFFIXES = (".json", ".txt", ".jinja", ".model")


class HubError(LoadError):
    """A model name that does not resolve: no such repo, not cached offline, no or several matching GGUFs."""


def is_hub_name(name) -> bool:
    """True when `name` is not a local path and reads as org/repo[:FILE]."""
    text = str(name)
    return not Path(text).expanduser().exists() and HUB_NAME.fullmatch(text) is not None


def resolve_model(name, hf_file: str | None = None, progress: bool = True) -> Path:
    """The local path of a model: `name` itself where it exists, else the files of a Hub name, downloaded (or
    found in the cache) by huggingface_hub.  hf_file: the GGUF to take from the repo (as org/repo:FILE).
    progress: huggingface_hub's download bars."""
    path = Path(str(name)).expanduser()
    if path.exists():
        if hf_file is not None:
            raise HubError(f"--hf-file {hf_file}: goes with a model name (org/repo), but {name} is a local path")
        return path
    match = HUB_NAME.fullmatch(str(name))
    if match is None:
        if hf_file is not None:
            raise HubError(f"--hf-file {hf_file}: {name} is not a model name of the form org/repo")
        raise FileNotFoundError(f"{name}: no such file or directory")
    repo, wanted = match["repo"], match["file"]
    if wanted is not None and hf_file is not None:
        raise HubError(f"{name} names a file and --hf-file {hf_file} another; give one")
    return _fetch(repo, wanted or hf_file, progress)


def _fetch(repo: str, wanted: str | None, progress: bool) -> Path:
    files = _repo_files(repo)
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if wanted is None:
        checkpoint = checkpoint_files(files)
        if checkpoint:
            return Path(_hub_call(repo, "snapshot_download", repo, allow_patterns=checkpoint, **_bars(progress)))
        if len(ggufs) == 1:
            wanted = ggufs[0]
        elif ggufs:
            raise HubError(f"{repo} has {len(ggufs)} GGUF files; name one as {repo}:QUANT (e.g. {repo}:Q4_K_M) or "
                           f"--hf-file FILE: {_listing(ggufs)}")
        else:
            raise HubError(f"{repo}: neither a safetensors checkpoint (config.json + *.safetensors) nor a GGUF "
                           f"file among its {len(files)} files")
    chosen = choose_gguf(repo, wanted, ggufs)
    return Path(_hub_call(repo, "hf_hub_download", repo, chosen, **_bars(progress)))


def checkpoint_files(files: list[str]) -> list[str]:
    """The files of a safetensors checkpoint among a repo's: config, tokenizer and template files and the
    weights at the top level; the model*.safetensors shards where there are (a repo may also hold the same
    weights in another layout, e.g. Mistral's consolidated.safetensors).  [] when it is not one."""
    top = [f for f in files if "/" not in f]
    weights = [f for f in top if f.endswith(".safetensors")]
    weights = [f for f in weights if f.startswith("model")] or weights
    if "config.json" not in top or not weights:
        return []
    return weights + [f for f in top if f.endswith(CHECKPOINT_SUFFIXES)]


def choose_gguf(repo: str, wanted: str, ggufs: list[str]) -> str:
    """The GGUF of `ggufs` that `wanted` names: a file name (FILE.gguf, with or without its folder), or a
    quantization (Q4_K_M, q8_0: the file whose name holds it, case-insensitive; a whole part of the name,
    split at - and ., wins over a longer one that contains it)."""
    if not ggufs:
        raise HubError(f"{repo} has no GGUF file (for {wanted!r}); without ':{wanted}' a safetensors checkpoint "
                       f"is loaded")
    if wanted.lower().endswith(".gguf"):
        found = [f for f in ggufs if f == wanted or f.rsplit("/", 1)[-1] == wanted]
        if found:
            return found[0]
        raise HubError(f"{repo} has no file {wanted}; its GGUF files: {_listing(ggufs)}")
    key = wanted.lower()
    found = [f for f in ggufs if key in _stem(f)]
    whole = [f for f in found if key in re.split(r"[-.]", _stem(f))]
    if len(whole) == 1 or len(found) == 1:
        return (whole or found)[0]
    if not found:
        raise HubError(f"{repo} has no GGUF file whose name contains {wanted!r}; its GGUF files: {_listing(ggufs)}")
    raise HubError(f"{repo}: {len(found)} GGUF files match {wanted!r}; name one as {repo}:FILE.gguf or "
                   f"--hf-file FILE: {_listing(found)}")


def _stem(file: str) -> str:
    return file.rsplit("/", 1)[-1].lower().removesuffix(".gguf")


def _listing(files: list[str]) -> str:
    return ", ".join(files)


def _bars(progress: bool) -> dict:
    if progress:
        return {}
    from tqdm.auto import tqdm

    class Quiet(tqdm):
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "disable": True})
    return {"tqdm_class": Quiet}


def _repo_files(repo: str) -> list[str]:
    """The repo's files: the Hub's listing, or the cached snapshot's where there is no network (offline mode,
    or the Hub unreachable)."""
    import huggingface_hub
    from huggingface_hub import errors
    if not huggingface_hub.is_offline_mode():
        try:
            return huggingface_hub.HfApi().list_repo_files(repo)
        except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as e:
            raise _not_found(repo, e) from None
        except Exception as e:          # the network: huggingface_hub's transport errors, whatever its client
            reason = e
    else:
        reason = None
    folder = _hub_call(repo, "snapshot_download", repo, local_files_only=True, offline_reason=reason)
    return sorted(Path(root, f).relative_to(folder).as_posix()
                  for root, _, names in os.walk(folder) for f in names)


def _hub_call(repo: str, function: str, *args, offline_reason: Exception | None = None, **kwargs) -> str:
    """huggingface_hub.`function`(*args, **kwargs), its errors said in one line that names the repo."""
    import huggingface_hub
    from huggingface_hub import errors
    try:
        return getattr(huggingface_hub, function)(*args, **kwargs)
    except errors.GatedRepoError as e:
        raise HubError(f"{repo} is gated: accept its terms on huggingface.co and log in (`hf auth login` or "
                       f"HF_TOKEN) ({_first_line(e)})") from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as e:
        raise _not_found(repo, e) from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, errors.IncompleteSnapshotError) as e:
        why = "HF_HUB_OFFLINE is set" if huggingface_hub.is_offline_mode() else \
            f"the Hub is unreachable ({_first_line(offline_reason or e)})"
        raise HubError(f"{repo}: not in the Hugging Face cache and {why}; download it once with the network "
                       f"(or give a local path)") from None
    except errors.HfHubHTTPError as e:
        raise HubError(f"{repo}: {_first_line(e)}") from None


def _not_found(repo: str, e: Exception) -> HubError:
    return HubError(f"{repo}: no such model on the Hugging Face Hub, nor a local path (a private repo needs "
                    f"`hf auth login` or HF_TOKEN) ({_first_line(e)})")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
