"""`berth serve --model DIR`: Hugging Face checkpoint directories served as
they are, with no berth.json written by hand.

Each ``--model`` is ``DIR`` or ``NAME=DIR``. The model's name is NAME, or
the directory's name lowercased, every run of characters other than
letters, digits, ``.``, ``_`` and ``-`` made one ``-``. Its task comes from
the checkpoint: a ``*ForSequenceClassification`` in config.json's
``architectures`` is a classify model with the checkpoint's own head
(services/hf_classifier.py), anything else an embed model (a
sentence-transformers checkpoint's pooling, length and normalization are
read as for any entry; a bare encoder's are the entry defaults).

serve writes a generated model repository under BERTH_CACHE_DIR, one
directory per set of flags (``serve-repositories/<digest>``): a berth.json
per ``--model`` whose ``checkpoint`` is the directory itself (no weights are
copied), and a link to each entry of ``--model-repository``, so that the
repository's models are served next to them. The processes then run on the
generated repository.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from services import hf_classifier
from services.repository import RepositoryError, load_entry

SERVE_REPOSITORIES = "serve-repositories"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_UNSAFE = re.compile(r"[^a-z0-9._-]+")


@dataclass(frozen=True)
class CheckpointModel:
    """One ``--model``: its name, its checkpoint directory, its task."""

    name: str
    directory: Path  # absolute
    task: str  # "embed" or "classify"


def split_spec(spec: str) -> tuple[str | None, str]:
    """``NAME=DIR`` -> (NAME, DIR); ``DIR`` -> (None, DIR). A NAME holds no
    ``/``, so that a directory with ``=`` in its path is read as a path."""
    name, sep, directory = spec.partition("=")
    if sep and name and "/" not in name:
        return name, directory
    return None, spec


def derive_name(directory: Path) -> str:
    """The directory's name, lowercased, other characters than letters,
    digits, ``.``, ``_``, ``-`` made ``-``."""
    return _UNSAFE.sub("-", directory.name.lower()).strip("-._")


def checkpoint_problem(directory: Path) -> str | None:
    """Why ``directory`` cannot be served as a checkpoint (None: it can)."""
    if not directory.is_dir():
        return "not a directory"
    config_file = directory / "config.json"
    if not config_file.is_file():
        return "no config.json (not a Hugging Face checkpoint directory)"
    try:
        config = json.loads(config_file.read_text())
        from engine.encoder import config_from_dict

        config_from_dict(config)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"config.json: {exc}"
    try:
        hf_classifier.read_classifier(directory)
    except hf_classifier.ClassifierConfigError as exc:
        return str(exc).removeprefix(f"{directory}: ")
    if not (directory / "tokenizer.json").is_file():
        return "no tokenizer.json (berth reads the fast tokenizer's file)"
    weights = ("model.safetensors", "model.safetensors.index.json")
    if not any((directory / name).is_file() for name in weights):
        return (
            "no model.safetensors (nor a sharded index); berth never loads "
            "pickled weights: save it with save_pretrained(..., "
            "safe_serialization=True)"
        )
    return None


def plan_models(specs: list[str]) -> list[CheckpointModel]:
    """Every ``--model``, checked; ValueError names the flag, the directory
    and the reason."""
    models: dict[str, CheckpointModel] = {}
    for spec in specs:
        given, raw = split_spec(spec)
        directory = Path(raw).expanduser().resolve()
        problem = checkpoint_problem(directory)
        if problem is not None:
            raise ValueError(f"--model {spec}: {directory}: {problem}")
        name = given if given is not None else derive_name(directory)
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"--model {spec}: {name!r} is no model name (letters, digits, "
                "'.', '_', '-', starting with a letter or digit); name it with "
                "--model NAME=DIR"
            )
        if name in models:
            raise ValueError(
                f"--model {spec}: the name {name!r} is taken by --model "
                f"{models[name].directory}; name one with --model NAME=DIR"
            )
        task = hf_classifier.checkpoint_task(directory)
        models[name] = CheckpointModel(name, directory, task)
    return list(models.values())


def repository_entries(repository: Path) -> dict[str, Path]:
    """The entry directories of ``repository`` by name ({} if it has none)."""
    if not repository.is_dir():
        return {}
    return {
        p.name: p.resolve()
        for p in sorted(repository.iterdir())
        if (p / "berth.json").is_file()
    }


def write_repository(
    models: list[CheckpointModel], repository: Path, cache: Path
) -> Path:
    """The generated repository of ``models`` and ``repository``'s entries
    (linked); ValueError for a name both have, or an entry berth refuses."""
    existing = repository_entries(repository)
    for model in models:
        if model.name in existing:
            raise ValueError(
                f"--model {model.directory}: the model repository {repository} "
                f"already has a model {model.name!r}; name this one with "
                f"--model OTHER={model.directory}"
            )
    key = {
        "repository": {name: str(path) for name, path in existing.items()},
        "models": [[m.name, str(m.directory)] for m in models],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    root = cache / SERVE_REPOSITORIES / digest[:16]
    root.mkdir(parents=True, exist_ok=True)
    wanted = set(existing) | {m.name for m in models}
    for stale in root.iterdir():
        if stale.name not in wanted:
            _remove(stale)
    for name, target in existing.items():
        link = root / name
        if not (link.is_symlink() and link.resolve() == target):
            _remove(link)
            link.symlink_to(target, target_is_directory=True)
    for model in models:
        entry_dir = root / model.name
        if entry_dir.is_symlink():
            _remove(entry_dir)
        entry_dir.mkdir(exist_ok=True)
        spec = {
            "name": model.name,
            "task": model.task,
            "checkpoint": str(model.directory),
        }
        text = json.dumps(spec, indent=2) + "\n"
        config_file = entry_dir / "berth.json"
        if not config_file.is_file() or config_file.read_text() != text:
            config_file.write_text(text)
        try:
            load_entry(entry_dir)
        except RepositoryError as exc:
            raise ValueError(f"--model {model.directory}: {exc}") from exc
    return root


def generated_names(root: Path) -> list[str]:
    """The generated repository's own entries (not the linked ones)."""
    return sorted(
        p.name
        for p in root.iterdir()
        if not p.is_symlink() and (p / "berth.json").is_file()
    )


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
