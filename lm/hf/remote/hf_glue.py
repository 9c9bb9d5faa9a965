"""What stands between transformers' calling convention and lm's layers (layers.py, attention.py, block.py, the
export's copies of lm's own files): transformers' cache seen as lm's per-layer cache, its attention_mask as lm's
masks, its position_ids, its accessors of the embeddings and its output classes. Plain torch.
"""

import torch
import torch.nn as nn

from .attention import key_padding_mask


class LayerCache:
    """One layer's keys and values in a transformers Cache, as lm's attention reads a cache (kv_cache.LayerKVCache):
    `length` positions so far, and `append`, which stores new ones and returns all."""

    def __init__(self, cache, layer_idx: int) -> None:
        self.cache, self.layer_idx = cache, layer_idx

    @property
    def length(self) -> int:
        return self.cache.get_seq_length(self.layer_idx)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, nkv, T, hs) -> those of every position so far, (B, nkv, length + T, hs)."""
        return self.cache.update(k, v, self.layer_idx)


def wants_cache(use_cache: bool | None, config, training: bool) -> bool:
    """Whether a forward given no cache starts one, as transformers' own models do: when use_cache says so, or,
    unset, when config.use_cache does and the model is not training (a training step reads no cache back)."""
    return use_cache if use_cache is not None else config.use_cache and not training


def layer_caches(cache, n_layer: int) -> list[LayerCache | None]:
    """Each layer's view of `cache`, or None for every layer without one."""
    return [None if cache is None else LayerCache(cache, i) for i in range(n_layer)]


def key_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """transformers' attention_mask (B, S), 1 for a real token and 0 for padding -> (B, 1, 1, S) bool, or None when
    there is no mask or nothing is padded (no mask lets SDPA pick its fastest kernel)."""
    if attention_mask is None or bool(attention_mask.bool().all()):
        return None
    return key_padding_mask(attention_mask.bool())


def padded_causal_mask(attention_mask: torch.Tensor | None, past: int, T: int, device: torch.device
                       ) -> torch.Tensor | None:
    """The self-attention mask of T new queries after `past` cached positions, (B, 1, T, past + T) bool: each query
    sees the earlier and its own position, padding (attention_mask 0) excepted; a padding query still sees itself,
    so that no row of the softmax is empty. None without padding: lm's attention then keeps to the causal
    triangle itself, after the cache or not."""
    padding = key_mask(attention_mask)
    if padding is None:
        return None
    query_pos = torch.arange(past, past + T, device=device)[:, None]  # (T, 1)
    key_pos = torch.arange(past + T, device=device)[None, :]  # (1, S)
    return (key_pos <= query_pos) & (padding | (key_pos == query_pos))  # (B, 1, T, S)


def token_positions(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, past: int, T: int,
                    device: torch.device) -> torch.Tensor:
    """Each new token's position: position_ids when given; else counted over the real tokens of attention_mask
    (B, past + T), so a left-padded row has the positions it would have alone; else past .. past + T - 1.
    (T,) or (B, T)."""
    if position_ids is not None:
        return position_ids
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
    return torch.arange(past, past + T, device=device)


class TokenEmbeddings:
    """transformers' accessors of a model whose token embedding is `wte` and output layer `lm_head` (lm's names)."""

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.wte = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value


def output_with_cache(output_class, cache, **fields):
    """A transformers output carrying the cache: transformers 5 names the field `cache`, 4.x `past_key_values`."""
    name = "cache" if "cache" in output_class.__dataclass_fields__ else "past_key_values"
    return output_class(**fields, **{name: cache})
