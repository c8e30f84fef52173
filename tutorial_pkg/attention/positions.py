"""Positions for real batches: left padding and packed documents. Chapter 4.

Attention takes positions ``(s,)`` (one row shared by the batch) or ``[b, s]`` (one
row per sequence), the convention of Hugging Face's ``position_ids`` and
torchtune's ``input_pos``. Two helpers build the ``[b, s]`` form:

* :func:`positions_from_padding`: in a left-padded batch the first real token of
  every row must sit at position 0, wherever it is in the row. Counting the real
  tokens before each token gives that position, as BLOOM and Hugging Face's
  ``generate`` do (``attention_mask.cumsum(-1) - 1``).
* :func:`positions_from_documents`: several documents packed into one row; each
  restarts at position 0 (and attention keeps them apart with a document mask).
"""

from __future__ import annotations

import torch

__all__ = ["positions_from_padding", "positions_from_documents"]


def positions_from_padding(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """Positions ``[b, L]`` that count real tokens: ``cumsum(not padding) - 1``.

    Args:
        key_padding_mask: bool ``[b, L]``, ``True`` where the token is padding
            (the convention of :class:`torch.nn.MultiheadAttention`).

    Returns:
        The positions (int64, shape ``[b, L]``). A real token's position is the number
        of real tokens before it; padding gets 0 (it is masked anyway). When decoding
        with a KV cache, the new tokens' positions are the last ``s`` columns of this,
        computed on the mask of every token so far.

    Example:
        >>> positions_from_padding(torch.tensor([[True, True, False, False, False]]))
        tensor([[0, 0, 0, 1, 2]])
    """
    if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
        raise TypeError("key_padding_mask must be a bool tensor [b, L] (True = padding), got "
                        f"{getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)}")
    if key_padding_mask.dim() != 2:
        raise ValueError(
            f"key_padding_mask must have shape [b, L], got {tuple(key_padding_mask.shape)}"
        )
    counted = (~key_padding_mask).long().cumsum(-1) - 1
    return counted.masked_fill(key_padding_mask, 0)


def positions_from_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions ``[b, L]`` that restart at 0 where a new document begins.

    Args:
        document_ids: integer ``[b, L]`` (or ``(L,)``); a document is a run of equal
            ids, so documents must be contiguous in the row.

    Returns:
        The index of each token within its document (int64, the shape of ``document_ids``).

    Example:
        >>> positions_from_documents(torch.tensor([[0, 0, 0, 1, 1, 2]]))
        tensor([[0, 1, 2, 0, 1, 0]])
    """
    if not isinstance(document_ids, torch.Tensor) or document_ids.is_floating_point() or (
        document_ids.dtype == torch.bool or document_ids.is_complex()
    ):
        raise TypeError("document_ids must be an integer tensor [b, L], got "
                        f"{getattr(document_ids, 'dtype', type(document_ids).__name__)}")
    if document_ids.dim() not in (1, 2):
        raise ValueError(f"document_ids must have shape (L,) or [b, L], got "
                         f"{tuple(document_ids.shape)}")
    index = torch.arange(document_ids.shape[-1], device=document_ids.device)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return index - first
