"""A preallocated KV cache with a fixed number of slots, one sequence per slot.

Each slot keeps its own length; a decode step writes one column per slot at that slot's length, and
attention reads all columns under a per-slot mask. A finished sequence frees its slot for the next
waiting request (continuous batching), so the batch stays full through the long tail.

The object follows the `update(key, value, layer_idx, **kwargs)` contract that Hugging Face attention
layers call; the 4-D mask handed to the model makes the library skip its own mask building.

Keys are stored transposed, `[slots, kv_heads, head_dim, capacity]`, so that the scores of a decode step
(`q @ K^T` over the first `width` columns) are a strided batched matmul. In fp32 on the CPU attention reads only
up to the longest slot; oneDNN's bf16 batched matmul copies strided operands, so in bf16 it reads the whole
(contiguous) capacity instead, which measured cheaper than the copy. Off the CPU it always reads the capacity
(masked): the longest slot's length lives on the device, and reading it back would stall every decode step on a
host sync (the engine's one read-back per step is the sampled tokens).
"""

from __future__ import annotations

import torch


class SlotCache:
    """Per layer: keys `[slots, kv_heads, head_dim, capacity]` and values `[slots, kv_heads, capacity, value_dim]`
    (`value_dim` defaults to `head_dim`); per-slot lengths `[slots]`."""

    def __init__(self, num_layers: int, slots: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", value_dim: int | None = None):
        self.keys = [torch.zeros((slots, kv_heads, head_dim, capacity), dtype=dtype, device=device)
                     for _ in range(num_layers)]
        self.values = [torch.zeros((slots, kv_heads, capacity, value_dim or head_dim), dtype=dtype, device=device)
                       for _ in range(num_layers)]
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)  # valid columns per slot
        self._read_full = dtype != torch.float32 or torch.device(device).type != "cpu"  # see the module's doc
        self._write_cols: torch.Tensor | None = None
        self._width = capacity

    @property
    def slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.values[0].shape[2]

    # -- called by the model's attention layers ------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write one new column per slot (key/value [slots, kv_heads, 1, head_dim]); return the cache
        up to the longest slot, [slots, kv_heads, width, head_dim]."""
        dtype = self.values[layer_idx].dtype
        keys_t, values = self.write(layer_idx, torch.arange(self.slots, device=self.lengths.device),
                                    key_states[:, :, 0].to(dtype),
                                    value_states[:, :, 0].to(dtype))
        return keys_t.transpose(-1, -2), values

    def write(self, layer_idx: int, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """Write this step's column of slots `rows` (key/value [slots, kv_heads, head_dim]); return views up to
        the longest slot: keys [slots, kv_heads, head_dim, width], values [slots, kv_heads, width, head_dim]."""
        cols = self._write_cols[rows]
        self.keys[layer_idx][rows, :, :, cols] = key
        self.values[layer_idx][rows, :, cols] = value
        width = self._width  # attend only up to the longest slot, not the whole capacity
        return self.keys[layer_idx][..., :width], self.values[layer_idx][:, :, :width]

    def attention_bias(self) -> torch.Tensor:
        """Additive mask of the current step, [slots, 1, 1, width] fp32: 0 on visible columns, -inf elsewhere."""
        cols = torch.arange(self._width, device=self.lengths.device)[None, :]
        visible = cols <= self._write_cols[:, None]
        bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
        bias.masked_fill_(~visible, float("-inf"))
        return bias[:, None, None, :]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max())

    # -- used by the engine -------------------------------------------------------------------------
    def begin_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Before a decode step: returns (positions [slots, 1], attention mask [slots, 1, 1, capacity] bool)."""
        self._write_cols = self.lengths.clamp(max=self.capacity - 1)
        self._width = self.capacity if self._read_full else int(self._write_cols.max()) + 1
        cols = torch.arange(self._width, device=self.lengths.device)[None, :]  # [1, W]
        mask = cols <= self._write_cols[:, None]  # [slots, W]: own columns plus the one being written
        return self._write_cols[:, None], mask[:, None, None, :]

    def window_mask(self, window: int) -> torch.Tensor:
        """`begin_step`'s mask for a sliding-window layer, [slots, 1, 1, width] bool: of each slot's columns up to
        the one being written, the last `window` (column c holds position c, so key c is visible to the query
        at position p when p - window < c <= p, as transformers' sliding masks have it)."""
        cols = torch.arange(self._width, device=self.lengths.device)[None, :]  # [1, W]
        written = self._write_cols[:, None]  # [slots, 1]
        return ((cols <= written) & (cols > written - window))[:, None, None, :]

    def end_step(self, active: torch.Tensor) -> None:
        """After a decode step: the written column becomes part of each active slot."""
        self.lengths += active.long()

    def load_prefill(self, slot_ids: torch.Tensor, layer_kv: list[tuple[torch.Tensor, torch.Tensor]],
                     rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Copy prefilled KV (right-padded, per layer [U, kv_heads, L, head_dim]) rows `rows` into `slot_ids`."""
        width = layer_kv[0][0].shape[2]
        for layer, (k, v) in enumerate(layer_kv):
            self.keys[layer][slot_ids, :, :, :width] = k[rows].transpose(-1, -2).to(self.keys[layer].dtype)
            self.values[layer][slot_ids, :, :width] = v[rows].to(self.values[layer].dtype)
        self.lengths[slot_ids] = lengths

    def keep(self, slot_ids: torch.Tensor) -> None:
        """Shrink to the given slots (in that order): used when the tail of a batch runs few sequences."""
        self.keys = [k[slot_ids].contiguous() for k in self.keys]
        self.values = [v[slot_ids].contiguous() for v in self.values]
        self.lengths = self.lengths[slot_ids].clone()
