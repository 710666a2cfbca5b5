"""A compressed outer sync: the pseudo-gradients cross the workers in bfloat16 or int8, with error feedback.

Each worker adds its residual ``e`` (what compression lost of its earlier pseudo-gradients,
``state["outer_residual"]``, zero at first) to its pseudo-gradient ``p``, sends ``c = C(p + e)`` and keeps
``e <- (p + e) - D(c)``, D the dequantization. bfloat16: ``c`` is ``p + e`` rounded (2 bytes an element). int8: the
flat bucket is cut into blocks of `INT8_BLOCK` = 256 elements (the last one shorter), each sent as int8
``q = round((p + e) / s)`` with its float32 scale ``s = max |p + e| / 127`` (1 + 4 / 256 bytes an element): a block of
256 keeps one outlier from coarsening more than 255 neighbours while its scale costs 1.6 % of the payload, and it does
not depend on the tensors' shapes.

No int8 or bf16 sum can overflow or round: the compressed values are dequantized and summed in float32, in the
workers' order, which gloo and NCCL do without a custom reduction, and gives the same bits on every process, equal to
a fixed-order simulation, for every M:

* M <= `ALL_GATHER_WORKERS` (2): an *all-gather* of the M payloads, summed locally and divided by M; each process
  sends its payload once, what a ring all-reduce sends of a float32 bucket at M = 2;
* M > 2: a *reduce-scatter of compressed chunks, then an all-gather of compressed averages*: the bucket is cut into
  M chunks (`chunk_numel`), chunk j of every worker goes to worker j (one all-to-all), which sums the M chunks,
  divides by M, adds its *server residual* (``state["outer_server_residual"]``: error feedback of this second
  compression) and compresses the average again; an all-gather hands every process the M compressed averages. Each
  process sends 2 (M - 1) / M of its compressed bucket, as a ring all-reduce sends of a float32 one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "ALL_GATHER_WORKERS",
    "INT8_BLOCK",
    "OUTER_DTYPES",
    "average_compressed",
    "chunk_numel",
    "compress",
    "decompress",
    "outer_payload_bytes",
    "outer_sent_bytes",
    "split_like",
]

#: The dtypes the pseudo-gradient may cross the workers in (``outer_dtype``, ``--diloco_outer_dtype``).
OUTER_DTYPES = ("float32", "bfloat16", "int8")
#: The elements of one int8 quantization block (one float32 scale each) of a flat bucket.
INT8_BLOCK = 256
#: Up to this many workers a compressed outer sync all-gathers the whole payloads (one quantization, one collective);
#: more reduce it chunk by chunk (`chunk_numel`), which sends 2 (M - 1) / M of the payload instead of M - 1 times it.
ALL_GATHER_WORKERS = 2


def outer_payload_bytes(numel: int, element_size: int, outer_dtype: str) -> int:
    """The payload of ``numel`` elements of ``element_size`` bytes (the outer weights' dtype) in ``outer_dtype``: the
    bytes of what `compress` makes of them (float32: the values as they are)."""
    if outer_dtype == "float32":
        return numel * element_size
    if outer_dtype == "bfloat16":
        return 2 * numel
    return numel + 4 * -(-numel // INT8_BLOCK)


def chunk_numel(numel: int, outer_dtype: str, num_workers: int) -> int:
    """The elements of each of the M chunks of a flat bucket of ``numel`` elements that more than
    `ALL_GATHER_WORKERS` workers reduce compressed: ``numel`` / M rounded up, for int8 to whole quantization blocks (a
    block never straddles two chunks; the chunks after the end are zeros)."""
    if outer_dtype == "int8":
        blocks = -(-numel // INT8_BLOCK)
        return -(-blocks // num_workers) * INT8_BLOCK
    return -(-numel // num_workers)


def outer_sent_bytes(numel: int, element_size: int, outer_dtype: str, num_workers: int) -> int:
    """The bytes one process sends to the other M - 1 workers to average a flat bucket of ``numel`` elements of
    ``element_size`` bytes in ``outer_dtype``, as a ring sends them: float32's all-reduce 2 (M - 1) / M of the
    bucket's bytes (rounded down); a compressed bucket, for M = 2, its payload once (the all-gather), for M > 2,
    2 (M - 1) chunk payloads (the all-to-all sends M - 1 chunks, the all-gather of the averaged chunks M - 1)."""
    m = num_workers
    if outer_dtype == "float32":
        return 2 * (m - 1) * numel * element_size // m
    if m <= ALL_GATHER_WORKERS:
        return (m - 1) * outer_payload_bytes(numel, element_size, outer_dtype)
    return 2 * (m - 1) * outer_payload_bytes(chunk_numel(numel, outer_dtype, m), element_size, outer_dtype)


def average_compressed(
    flat: torch.Tensor,
    residuals: Sequence[torch.Tensor],
    servers: Sequence[torch.Tensor] | None,
    views: Sequence[torch.Tensor],
    outer_dtype: str,
    group: Any,
) -> None:
    """Replace the flat bucket ``flat`` of this worker's pseudo-gradients (whose tensors are ``views``) by their
    average over the workers of ``group``, sent compressed with error feedback: each tensor's residual (``residuals``)
    is added first and updated in place; with more than `ALL_GATHER_WORKERS` workers so are this worker's server
    residuals (``servers``)."""
    import torch.distributed as dist

    num_workers = dist.get_world_size(group)
    for view, residual in zip(views, residuals):
        view.add_(residual)  # p + e
    if num_workers <= ALL_GATHER_WORKERS:
        payload, dequantized = compress(flat, outer_dtype)
        gathered = [torch.empty_like(payload) for _ in range(num_workers)]
        dist.all_gather(gathered, payload, group=group)
        total = decompress(gathered[0], flat, outer_dtype)
        for other in gathered[1:]:
            total.add_(decompress(other, flat, outer_dtype))  # the workers' order, in the outer dtype
        total.div_(num_workers)
    else:
        assert servers is not None, "a compressed reduce-scatter needs the server residuals"
        dequantized, total = _reduce_scatter_all_gather(flat, servers, outer_dtype, group)
    for view, kept, residual in zip(views, split_like(dequantized, views), residuals):
        torch.sub(view, kept, out=residual)  # e <- (p + e) - D(C(p + e))
    flat.copy_(total)


def _reduce_scatter_all_gather(
    values: torch.Tensor, servers: Sequence[torch.Tensor], outer_dtype: str, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The average over the M > 2 workers of the flat ``values`` (p + e) of each, sent compressed in two stages: each
    worker cuts its ``values`` into M chunks of `chunk_numel` elements (zeros after the end), compresses each and sends
    chunk j to worker j (one all-to-all); worker j sums the M chunks it received, dequantized, in float (the workers'
    order), divides by M, adds its server residual for chunk j (``servers``: one per tensor of the bucket, the shape of
    the tensor, of which this worker uses the elements in its chunk), compresses that again, keeps what the second
    compression lost as its new server residual, and all-gathers the compressed averages, which every process
    dequantizes: the same bits everywhere. Returns (``values`` as this worker sent them, dequantized; the average)."""
    import torch.distributed as dist

    m, n = dist.get_world_size(group), values.numel()
    me = dist.get_rank(group)  # the outer group's rank of a process is its worker
    c = chunk_numel(n, outer_dtype, m)
    padded = values.new_zeros(m * c)
    padded[:n] = values
    chunks = padded.view(m, c)
    compressed = [compress(chunk, outer_dtype) for chunk in chunks]
    sent = torch.stack([payload for payload, _ in compressed])
    dequantized = torch.cat([kept for _, kept in compressed])[:n]
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    mine = chunks[me]
    total = decompress(received[0], mine, outer_dtype)
    for other in received[1:]:
        total.add_(decompress(other, mine, outer_dtype))  # the workers' order, in the outer dtype
    total.div_(m)
    owned = _overlaps([s.numel() for s in servers], me * c, min((me + 1) * c, n))
    for i, start, stop, at in owned:
        total[at : at + stop - start].add_(servers[i].view(-1)[start:stop])  # + the server residual
    payload, kept = compress(total, outer_dtype)
    for i, start, stop, at in owned:
        torch.sub(total[at : at + stop - start], kept[at : at + stop - start], out=servers[i].view(-1)[start:stop])
    gathered = [torch.empty_like(payload) for _ in range(m)]
    dist.all_gather(gathered, payload, group=group)
    average = torch.cat([decompress(other, mine, outer_dtype) for other in gathered])[:n]
    return dequantized, average


def _overlaps(numels: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int, int]]:
    """The elements [start, stop) of a flat bucket of tensors of ``numels`` elements, tensor by tensor: (the tensor,
    the first and end element within it, the position of the first within [start, stop))."""
    out, offset = [], 0
    for i, numel in enumerate(numels):
        lo, hi = max(start, offset), min(stop, offset + numel)
        if lo < hi:
            out.append((i, lo - offset, hi - offset, lo - start))
        offset += numel
    return out


def split_like(flat: torch.Tensor, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into consecutive views of the shapes of ``views``."""
    out, offset = [], 0
    for view in views:
        out.append(flat[offset : offset + view.numel()].view(view.shape))
        offset += view.numel()
    return out


def compress(values: torch.Tensor, outer_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, its dequantization) of a flat ``values`` in ``outer_dtype``: bfloat16, the values rounded; int8, a
    uint8 buffer of the int8 values of every block of `INT8_BLOCK` elements followed by their float32 scales (the
    bytes of ``outer_payload_bytes``)."""
    if outer_dtype == "bfloat16":
        payload = values.to(torch.bfloat16)
        return payload, payload.to(values.dtype)
    n = values.numel()
    blocks = _blocks(values)
    scales = blocks.abs().amax(dim=1).to(torch.float32) / 127
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).to(values.dtype)
    quantized = torch.round(blocks / divisor[:, None]).clamp_(-127, 127).to(torch.int8)
    payload = torch.cat([quantized.view(-1)[:n].view(torch.uint8), scales.view(torch.uint8)])
    return payload, _dequantize(quantized, scales, values)


def decompress(payload: torch.Tensor, like: torch.Tensor, outer_dtype: str) -> torch.Tensor:
    """The values of a `compress` payload, in ``like``'s dtype and flat shape."""
    if outer_dtype == "bfloat16":
        return payload.to(like.dtype)
    n = like.numel()
    count = -(-n // INT8_BLOCK)
    quantized = torch.zeros(count * INT8_BLOCK, dtype=torch.int8, device=like.device)
    quantized[:n] = payload[:n].view(torch.int8)
    scales = payload[n:].clone().view(torch.float32)
    return _dequantize(quantized.view(count, INT8_BLOCK), scales, like)


def _blocks(values: torch.Tensor) -> torch.Tensor:
    """``values`` (flat) as rows of `INT8_BLOCK`, the last one padded with zeros."""
    n = values.numel()
    padded = values.new_zeros(-(-n // INT8_BLOCK) * INT8_BLOCK)
    padded[:n] = values
    return padded.view(-1, INT8_BLOCK)


def _dequantize(quantized: torch.Tensor, scales: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return (quantized.to(like.dtype) * scales.to(like.dtype)[:, None]).view(-1)[: like.numel()]
